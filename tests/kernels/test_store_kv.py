"""store_kv (Triton) == store_kv_reference (torch), and the reference puts each token where the
slot id says. Quantized pools (fp8 e4m3/e5m2, int8 with in-row scales): the kernel writes the
same bytes as the reference, the reference decodes back to within the format's resolution."""

import pytest
import torch

from kernels import dequantize_kv_reference, quantize_kv_reference, store_kv, store_kv_reference

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 3, 16, 3, 64


QUANTIZED = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def _pool(
    dtype=torch.float32, device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, d_stored=None
):
    """Random contents; quantized pools get random bytes (NaN codes included), int8 pools
    head_dim + 4 bytes per row."""
    gen = torch.Generator().manual_seed(0)
    if d_stored is None:
        d_stored = HEAD_DIM + 4 if dtype == torch.int8 else HEAD_DIM
    shape = (num_blocks, NUM_KV_HEADS, NUM_LAYERS, 2, block_size, d_stored)
    if dtype in QUANTIZED:
        return (
            torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8).view(dtype).to(device)
        )
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def _bytes(pool):
    return pool.view(torch.uint8)


def _step(
    num_tokens, dtype=torch.float32, device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS
):
    """key/value as strided views of a fused qkv buffer, distinct shuffled slots, some -1."""
    gen = torch.Generator().manual_seed(1)
    q_width = 9 * HEAD_DIM
    kv_width = NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=gen).to(
        dtype=dtype, device=device
    )
    key = qkv[:, q_width : q_width + kv_width].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, q_width + kv_width :].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
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
        assert torch.equal(pool[block, :, 2, 0, offset], key[t])
        assert torch.equal(pool[block, :, 2, 1, offset], value[t])
        written[block, offset] = True
    untouched = before.clone()
    # [N, H, L, 2, B, D] -> [N, B, 2, H, D] for layer 2: `written` picks (block, offset).
    order = (0, 3, 2, 1, 4)
    untouched[:, :, 2].permute(order)[written] = pool[:, :, 2].permute(order)[written]
    assert torch.equal(pool, untouched), "slots -1 or other layers were modified"
    assert written.sum() == (slots >= 0).sum()


def test_all_slots_skipped_and_empty_step(device):
    key, value, slots = _step(5, device=device)
    pool = _pool(device=device)
    before = pool.clone()
    store_kv(key, value, pool, 0, torch.full_like(slots, -1))
    store_kv(key[:0], value[:0], pool, 0, slots[:0])
    assert torch.equal(pool, before)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(key=a["key"].double()), "dtype"),
        (lambda a: a.update(key=a["key"][:, :2]), "key must be"),
        (lambda a: a.update(value=a["value"][:-1]), "tokens"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "int32/int64"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]), "slot_mapping must be"),
        (lambda a: a.update(layer=NUM_LAYERS), "out of range"),
        (lambda a: a.update(key=a["key"].transpose(1, 2)), "key must be"),
        (
            lambda a: a.update(key=torch.randn(21, NUM_KV_HEADS, 2 * HEAD_DIM)[..., ::2]),
            "contiguous last dim",
        ),
    ],
)
def test_launcher_rejects_bad_arguments(mutate, message):
    key, value, slots = _step(21)
    args = dict(key=key, value=value, kv_cache=_pool(), layer=1, slot_mapping=slots)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        store_kv(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantized_kernel_writes_reference_bytes(kv_dtype, dtype, device):
    key, value, slots = _step(21, dtype, device)
    key = key * torch.logspace(-6, 4, 21, device=device)[:, None, None].to(
        dtype
    )  # subnormal .. saturated
    expected, actual = _pool(kv_dtype, device), _pool(kv_dtype, device)
    store_kv_reference(key, value, expected, 1, slots)
    store_kv(key, value, actual, 1, slots)
    assert torch.equal(_bytes(actual), _bytes(expected))


def _fp8_edge_values(fp8):
    """Every fp8 value, every midpoint between neighbours (round-to-even ties) and 1 fp32 ulp
    either side of it, +-0, NaN, values past the range and below the smallest subnormal."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    finite = codes[codes.isfinite()].unique()  # sorted, -max .. max
    mid = (finite[:-1] + finite[1:]) / 2
    ulp = torch.tensor(1, dtype=torch.int32)
    around = torch.cat(
        [
            (mid.view(torch.int32) + ulp).view(torch.float32),
            (mid.view(torch.int32) - ulp).view(torch.float32),
        ]
    )
    smallest = finite[finite > 0].min()
    extra = torch.tensor(
        [
            0.0,
            -0.0,
            float("nan"),
            -float("nan"),
            float("inf"),
            -float("inf"),
            1e6,
            -1e6,
            smallest / 2,
            -smallest / 2,
            smallest / 3,
            smallest * 0.75,
            1e-30,
        ]
    )
    return torch.cat([finite, mid, around, extra])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_encoding_edge_cases(kv_dtype, device):
    values = _fp8_edge_values(kv_dtype)
    per_token = NUM_KV_HEADS * HEAD_DIM
    num_tokens = -(-values.numel() // per_token)
    key = torch.zeros(num_tokens * per_token)
    key[: values.numel()] = values
    key = key.view(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(device)
    slots = torch.arange(num_tokens, device=device)
    expected, actual = _pool(kv_dtype, device), _pool(kv_dtype, device)
    store_kv_reference(key, key, expected, 0, slots)
    store_kv(key, key, actual, 0, slots)
    assert torch.equal(_bytes(actual), _bytes(expected))
    # The reference is torch's saturating cast: finite values stay finite.
    stored = (
        expected[slots // BLOCK_SIZE, :, 0, 0, slots % BLOCK_SIZE]
        .flatten()[: values.numel()]
        .float()
        .cpu()
    )
    assert not stored[~values.isnan()].isnan().any()
    assert stored[values.isnan()].isnan().all()


def test_int8_layout_and_rounding(device):
    # Row 0: max|x| = 127 -> s = 1 exactly, so x / s hits the .5 ties: rounded half to even.
    # Row 1: all zeros -> s = 1e-8 / 127, q = 0. Other rows random.
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    ties = torch.tensor([127.0, -127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.49, 3.51])
    key[0, 0, : ties.numel()] = ties
    key[0, 0, ties.numel() :] = 0
    key[1] = 0
    stored = quantize_kv_reference(key, torch.int8)
    assert stored.shape == (3, NUM_KV_HEADS, HEAD_DIM + 4) and stored.dtype == torch.int8
    assert stored[0, 0, : ties.numel()].tolist() == [127, -127, 0, 2, 2, 0, -2, -2, 126, -126, 3, 4]
    scales = stored[..., HEAD_DIM:].contiguous().view(torch.float32).squeeze(-1)
    assert scales[0, 0] == 1.0
    assert scales[1].eq(torch.tensor(1e-8) / 127).all() and stored[1, :, :HEAD_DIM].eq(0).all()
    torch.testing.assert_close(scales[2], key[2].abs().amax(-1) / 127)
    decoded = dequantize_kv_reference(stored)
    assert (decoded - key).abs().le(scales[..., None] / 2 * (1 + 1e-5)).all()
    # The kernel writes the same bytes.
    pool = _pool(torch.int8, device)
    store_kv(key.to(device), key.to(device), pool, 2, torch.tensor([5, 40, 77], device=device))
    assert torch.equal(pool[0, :, 2, 0, 5].cpu(), stored[0]) and torch.equal(
        pool[2, :, 2, 1, 8].cpu(), stored[1]
    )
    assert torch.equal(pool[4, :, 2, 0, 13].cpu(), stored[2])


@pytest.mark.parametrize(
    "kv_dtype,d_stored,message",
    [
        (torch.int8, HEAD_DIM, "key must be"),  # no room for the scales
        (torch.int8, HEAD_DIM + 2 + 4, "multiple of 4"),  # misaligned scales
        (torch.float8_e4m3fn, HEAD_DIM + 4, "key must be"),  # fp8 has no scales
        (torch.int16, HEAD_DIM, "kv_cache dtype"),
    ],
)
def test_launcher_rejects_pool_of_no_format(kv_dtype, d_stored, message):
    key, value, slots = _step(21)
    pool = torch.zeros(
        NUM_BLOCKS, NUM_KV_HEADS, NUM_LAYERS, 2, BLOCK_SIZE, d_stored, dtype=kv_dtype
    )
    for fn in (store_kv, store_kv_reference):
        with pytest.raises(ValueError, match=message):
            fn(key, value, pool, 1, slots)


def test_quantized_launcher_rejects_integer_key():
    key, value, slots = _step(21)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(key.to(torch.int8), value.to(torch.int8), _pool(torch.int8), 1, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_kernel_matches_reference(dtype):
    # A prefill-sized step (8192 tokens) into a 4096-block pool.
    key, value, slots = _step(8192, dtype, "cuda", num_blocks=4096)
    expected, actual = _pool(dtype, "cuda", num_blocks=4096), _pool(dtype, "cuda", num_blocks=4096)
    store_kv_reference(key, value, expected, 1, slots)
    store_kv(key, value, actual, 1, slots)
    assert torch.equal(actual, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_gpu_quantized_kernel_matches_reference(kv_dtype):
    key, value, slots = _step(8192, torch.bfloat16, "cuda", num_blocks=4096)
    expected, actual = (
        _pool(kv_dtype, "cuda", num_blocks=4096),
        _pool(kv_dtype, "cuda", num_blocks=4096),
    )
    store_kv_reference(key, value, expected, 1, slots)
    store_kv(key, value, actual, 1, slots)
    assert torch.equal(_bytes(actual), _bytes(expected))
