"""Structured outputs: constrain sampling to a JSON schema, regex, choice or grammar.

params.py (what a request asks for, vLLM's StructuredOutputsParams), compiler.py (the
grammar backend, xgrammar, compiled against this tokenizer's vocabulary and cached by
content), state.py (a sequence's matcher: the mask for its next token, advanced by every
token it keeps). The sampler applies the masks (engine/logits_masks.py); the scheduler
advances the matchers and finishes a sequence whose grammar is complete."""
