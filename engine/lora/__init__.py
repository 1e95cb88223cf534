"""Multi-LoRA: many adapters over one base model, batched in one forward.

request.py (LoRARequest, vLLM's), adapter.py (a PEFT adapter read from disk and checked
against the base model), slots.py (the adapters resident for the forward: `max_loras` slots of
stacked, rank-padded weights, LRU; plus the CPU cache of loaded adapters, `max_cpu_loras`),
batch.py (one step's token -> slot mapping and the shrink/expand that adds each row's
B(A x) to the base projections)."""
