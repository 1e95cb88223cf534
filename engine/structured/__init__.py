"""Structured outputs: constrain sampling to a JSON schema, regex, choice or grammar.

params.py (what a request asks for, vLLM's StructuredOutputsParams), backend.py (the grammar
backend, xgrammar: a constraint compiled against this tokenizer's vocabulary), compiler.py
(the compile cache, by content, and where a compile runs), compile_process.py (the killable
child processes that compile with a time limit; the router's too), state.py (a sequence's
matcher: the mask for its next token, advanced by every token it keeps), gate.py (a reasoning
model's thinking is never masked: the grammar binds after its end marker). The sampler applies
the masks (engine/sampling/logits_masks.py); the scheduler advances the matchers and finishes a
sequence whose grammar is complete."""
