"""store_kv (Triton) == store_kv_reference (torch), and the reference puts each token where the
slot id says."""
import pytest
import torch

from kernels import store_kv, store_kv_reference

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 3, 16, 3, 64


def _pool(dtype=torch.float32, device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS):
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, NUM_LAYERS, 2, block_size, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def _step(num_tokens, dtype=torch.float32, device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS):
    """key/value as strided views of a fused qkv buffer, distinct shuffled slots, some -1."""
    gen = torch.Generator().manual_seed(1)
    q_width = 9 * HEAD_DIM
    kv_width = NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=gen).to(dtype=dtype, device=device)
    key = qkv[:, q_width:q_width + kv_width].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, q_width + kv_width:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    slots[::4] = -1
    return key, value, slots


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(dtype, slot_dtype, device):
    key, value, slots = _step(21, dtype, device)
    expected, actual = _pool(dtype, device), _pool(dtype, device)
    store_kv_reference(key, value, expected, 1, slots.to(slot_dtype))
    store_kv(key, value, actual, 1, slots.to(slot_dtype))
    assert torch.equal(actual, expected)


def test_reference_places_tokens_and_skips_minus_one():
    key, value, slots = _step(21)
    pool = _pool()
    before = pool.clone()
    store_kv_reference(key, value, pool, 2, slots)
    written = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, BLOCK_SIZE)
        assert torch.equal(pool[block, 2, 0, offset], key[t])
        assert torch.equal(pool[block, 2, 1, offset], value[t])
        written[block, offset] = True
    untouched = before.clone()
    untouched[:, 2].transpose(1, 2)[written] = pool[:, 2].transpose(1, 2)[written]
    assert torch.equal(pool, untouched), "slots -1 or other layers were modified"
    assert written.sum() == (slots >= 0).sum()


def test_all_slots_skipped_and_empty_step(device):
    key, value, slots = _step(5, device=device)
    pool = _pool(device=device)
    before = pool.clone()
    store_kv(key, value, pool, 0, torch.full_like(slots, -1))
    store_kv(key[:0], value[:0], pool, 0, slots[:0])
    assert torch.equal(pool, before)


@pytest.mark.parametrize("mutate,message", [
    (lambda a: a.update(key=a["key"].double()), "dtype"),
    (lambda a: a.update(key=a["key"][:, :2]), "key must be"),
    (lambda a: a.update(value=a["value"][:-1]), "tokens"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "int32/int64"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]), "slot_mapping must be"),
    (lambda a: a.update(layer=NUM_LAYERS), "out of range"),
    (lambda a: a.update(key=a["key"].transpose(1, 2)), "key must be"),
    (lambda a: a.update(key=torch.randn(21, NUM_KV_HEADS, 2 * HEAD_DIM)[..., ::2]), "contiguous last dim"),
])
def test_launcher_rejects_bad_arguments(mutate, message):
    key, value, slots = _step(21)
    args = dict(key=key, value=value, kv_cache=_pool(), layer=1, slot_mapping=slots)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        store_kv(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_kernel_matches_reference(dtype):
    # A prefill-sized step (8192 tokens) into a 4096-block pool.
    key, value, slots = _step(8192, dtype, "cuda", num_blocks=4096)
    expected, actual = _pool(dtype, "cuda", num_blocks=4096), _pool(dtype, "cuda", num_blocks=4096)
    store_kv_reference(key, value, expected, 1, slots)
    store_kv(key, value, actual, 1, slots)
    assert torch.equal(actual, expected)
