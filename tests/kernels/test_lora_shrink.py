"""lora_shrink (Triton) == lora_shrink_reference (torch) == a per-token loop of
a_stack[slot] @ x[t]."""

import pytest
import torch

from kernels import lora_shrink, lora_shrink_reference

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-3, rtol=1e-3),
}  # output is fp32 in every case
SLOTS = [2, -1, 0, 0, 1, -1, 2, 0]


def _inputs(num_tokens, hidden, rank, num_slots=3, dtype=torch.float32, device="cpu", slots=None):
    """x, a_stack (slot 1 has true rank rank // 2, zero-padded), token_slots (mixed, some -1)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype=dtype, device=device)
    a_stack = torch.randn(num_slots, rank, hidden, generator=gen) / hidden**0.5
    a_stack[1 % num_slots, rank // 2 :] = 0
    if slots is None:
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    return x, a_stack.to(dtype=dtype, device=device), torch.as_tensor(slots).to(device)


def test_reference_matches_per_token_loop():
    x, a_stack, slots = _inputs(8, 64, 16, slots=SLOTS)
    expected = torch.zeros(8, 16)
    for t, slot in enumerate(SLOTS):
        if slot >= 0:
            expected[t] = a_stack[slot] @ x[t]
    torch.testing.assert_close(
        lora_shrink_reference(x, a_stack, slots), expected, **TOL[torch.float32]
    )
    assert torch.equal(lora_shrink_reference(x, a_stack, slots)[[1, 5]], torch.zeros(2, 16))


@pytest.mark.parametrize("hidden", [64, 40])
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kernel_matches_reference(rank, hidden, slot_dtype, device):
    x, a_stack, slots = _inputs(8, hidden, rank, dtype=torch.float32, device=device, slots=SLOTS)
    slots = slots.to(slot_dtype)
    out = lora_shrink(x, a_stack, slots)
    assert out.shape == (8, rank) and out.dtype == torch.float32
    torch.testing.assert_close(out, lora_shrink_reference(x, a_stack, slots), **TOL[torch.float32])
    assert torch.equal(out[[1, 5]], torch.zeros(2, rank, device=device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype, device):
    x, a_stack, slots = _inputs(5, 48, 8, dtype=dtype, device=device)
    torch.testing.assert_close(
        lora_shrink(x, a_stack, slots), lora_shrink_reference(x, a_stack, slots), **TOL[dtype]
    )


@pytest.mark.parametrize("split_k", [1, 3])
def test_out_argument_and_split_k(split_k, device):
    # hidden 64 with rank 256 -> 16-wide K tiles, so split_k=3 really splits (4 tiles).
    x, a_stack, slots = _inputs(4, 64, 256, num_slots=2, device=device, slots=[1, -1, 0, 1])
    out = torch.full((4, 256), float("nan"), device=device)
    assert lora_shrink(x, a_stack, slots, out, split_k=split_k) is out
    torch.testing.assert_close(out, lora_shrink_reference(x, a_stack, slots), **TOL[torch.float32])


def test_strided_views_all_skipped_and_empty(device):
    x, a_stack, slots = _inputs(6, 2 * 32, 8, device=device)
    x = x[:, 32:]  # row-strided view
    a_stack = torch.cat([a_stack[..., :32], a_stack[..., :32]], dim=1)[:, ::2]  # strided rows
    torch.testing.assert_close(
        lora_shrink(x, a_stack, slots),
        lora_shrink_reference(x, a_stack, slots),
        **TOL[torch.float32],
    )
    none = torch.full_like(slots, -1)
    assert torch.equal(lora_shrink(x, a_stack, none), torch.zeros(6, 8, device=device))
    assert lora_shrink(x[:0], a_stack, slots[:0]).shape == (0, 8)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(x=a["x"].int()), "x dtype"),
        (lambda a: a.update(x=a["x"][None]), "x must be"),
        (lambda a: a.update(a_stack=a["a_stack"].half()), "a_stack dtype"),
        (lambda a: a.update(a_stack=a["a_stack"][..., :32]), "a_stack must be"),
        (lambda a: a.update(a_stack=a["a_stack"][0]), "a_stack must be"),
        (lambda a: a.update(x=torch.randn(8, 128)[:, ::2]), "x must have a contiguous last dim"),
        (
            lambda a: a.update(a_stack=a["a_stack"].transpose(1, 2).contiguous().transpose(1, 2)),
            "contiguous",
        ),
        (lambda a: a.update(token_slots=a["token_slots"].float()), "int32/int64"),
        (lambda a: a.update(token_slots=a["token_slots"][:-1]), "token_slots must be"),
        (lambda a: a.update(out=torch.zeros(8, 16, dtype=torch.float16)), "out must be float32"),
        (lambda a: a.update(out=torch.zeros(8, 8)), "out must be"),
        (lambda a: a.update(split_k=0), "split_k"),
    ],
)
def test_launcher_rejects_bad_arguments(mutate, message):
    x, a_stack, slots = _inputs(8, 64, 16, slots=SLOTS)
    args = dict(x=x, a_stack=a_stack, token_slots=slots)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        lora_shrink(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_matches_reference(dtype, split_k):
    # A prefill-sized step, 4 adapters of rank 64 on a 4096-wide input.
    x, a_stack, slots = _inputs(4096, 4096, 64, num_slots=4, dtype=dtype, device="cuda")
    torch.testing.assert_close(
        lora_shrink(x, a_stack, slots, split_k=split_k),
        lora_shrink_reference(x, a_stack, slots),
        **TOL[dtype],
    )
