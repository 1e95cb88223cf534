"""Sampling: request parameters (sampling, pooling) and turning logits into
tokens (masks, penalties, the sampler)."""
