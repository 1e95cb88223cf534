"""Greedy generation for one sequence over a private paged pool (foundation path; the paged
engine's scheduler replaces it for serving)."""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, TorchAttentionBackend
from engine.models.llama import ForwardContext
from engine.models.loader import LoadedModel


def single_sequence_metadata(
    start: int, num_new: int, block_size: int, num_blocks: int
) -> AttentionMetadata:
    """Metadata for positions start..start+num_new-1 of one sequence on blocks 0..n-1."""
    seq_len = start + num_new
    return AttentionMetadata(
        slot_mapping=torch.arange(start, seq_len, dtype=torch.int64),
        query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
        query_lens_cpu=[num_new],
        seq_lens_cpu=[seq_len],
        num_decodes=1 if num_new == 1 else 0,
        max_query_len=num_new,
        max_seq_len=seq_len,
    )


@torch.inference_mode()
def greedy_generate(
    loaded: LoadedModel, prompt_ids: list[int], max_tokens: int, block_size: int = 16
) -> list[int]:
    args = loaded.args
    total = len(prompt_ids) + max_tokens
    num_blocks = -(-total // block_size)
    param = next(loaded.model.parameters())
    kv_cache = torch.zeros(
        num_blocks, args.n_layers, 2, block_size, args.n_kv_heads, args.head_dim,
        dtype=param.dtype, device=param.device,
    )
    backend = TorchAttentionBackend()
    out: list[int] = []
    ids, start = list(prompt_ids), 0
    while len(out) < max_tokens:
        meta = single_sequence_metadata(start, len(ids), block_size, num_blocks)
        logits = loaded.model(
            torch.tensor(ids, device=param.device),
            torch.arange(start, start + len(ids), device=param.device),
            ForwardContext(backend, kv_cache, meta),
            logits_indices=torch.tensor([len(ids) - 1], device=param.device),
        )
        token = int(logits[0].argmax())
        out.append(token)
        if token in loaded.tokenizer.stop_token_ids:
            break
        start, ids = start + len(ids), [token]
    return out
