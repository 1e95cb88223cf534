"""Input and output processing: tokenizer and detokenizer, building requests,
per-step deltas and the offline outputs, plain token values."""
