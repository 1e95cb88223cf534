"""Speculative decoding: proposers draft tokens, the target verifies them in one forward.

Life of a step with speculation (engine.llm_engine.LLMEngine.step):
1. The scheduler gives a decoding sequence 1 + k slots and counts 1 + k tokens against the
   step's budget (k from its SpecState policy, cut to fit the budget, max_tokens and
   max_model_len).
2. The proposer drafts up to k tokens; the step takes them
   (`SchedulerOutput.with_drafts`: cut by the grammar) and is sized to them.
3. The model runner computes the last token plus the drafts and verifies (verify.py).
4. The scheduler keeps the accepted tokens one by one under the usual stop rules, rolls
   `num_computed_tokens` back over the rejected drafts and returns the blocks they no
   longer need (prefix-cache hashes only ever cover accepted tokens).
"""
