"""lora_expand (Triton) == lora_expand_reference (torch) == a per-token loop; shrink + expand ==
the dense LoRA formula y + scale * B @ (A @ x) per token; column slices of a fused output."""

import pytest
import torch

from kernels import lora_expand, lora_expand_reference, lora_shrink

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
SLOTS = [2, -1, 0, 0, 1, -1, 2, 0]


def _inputs(num_tokens, width, rank, num_slots=3, dtype=torch.float32, device="cpu", slots=None):
    """y, shrunk, b_stack (slot 1 has true rank rank // 2, zero-padded), token_slots, scale."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(num_tokens, width, generator=gen).to(dtype=dtype, device=device)
    shrunk = torch.randn(num_tokens, rank, generator=gen).to(device)
    b_stack = torch.randn(num_slots, width, rank, generator=gen) / rank**0.5
    b_stack[1 % num_slots, :, rank // 2 :] = 0
    scale = torch.tensor([2.0, 0.5, 1.0, 4.0][:num_slots]).to(device)
    if slots is None:
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    return (
        y,
        shrunk,
        b_stack.to(dtype=dtype, device=device),
        torch.as_tensor(slots).to(device),
        scale,
    )


def test_reference_matches_per_token_loop():
    y, shrunk, b_stack, slots, scale = _inputs(8, 64, 16, slots=SLOTS)
    expected = y.clone()
    for t, slot in enumerate(SLOTS):
        if slot >= 0:
            expected[t] += scale[slot] * (b_stack[slot] @ shrunk[t])
    before = y.clone()
    lora_expand_reference(y, shrunk, b_stack, slots, scale)
    torch.testing.assert_close(y, expected, **TOL[torch.float32])
    assert torch.equal(y[[1, 5]], before[[1, 5]])


@pytest.mark.parametrize("width", [64, 40])
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kernel_matches_reference(rank, width, slot_dtype, device):
    y, shrunk, b_stack, slots, scale = _inputs(8, width, rank, device=device, slots=SLOTS)
    slots = slots.to(slot_dtype)
    expected, before = y.clone(), y.clone()
    lora_expand_reference(expected, shrunk, b_stack, slots, scale)
    lora_expand(y, shrunk, b_stack, slots, scale)
    torch.testing.assert_close(y, expected, **TOL[torch.float32])
    assert torch.equal(y[[1, 5]], before[[1, 5]]), "rows with slot -1 were modified"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_outputs(dtype, device):
    y, shrunk, b_stack, slots, scale = _inputs(5, 48, 8, dtype=dtype, device=device)
    expected = y.clone()
    lora_expand_reference(expected, shrunk, b_stack, slots, scale)
    lora_expand(y, shrunk, b_stack, slots, scale)
    torch.testing.assert_close(y, expected, **TOL[dtype])


def test_fused_qkv_column_slices(device):
    """Shrink q/k/v A stacks together ([S, 3R, H_in]); expand each B stack into its column slice
    of the fused output. Columns outside each slice, and rows with slot -1, stay as they were."""
    gen = torch.Generator().manual_seed(1)
    hidden, rank, widths = 32, 8, (32, 16, 16)
    x = torch.randn(8, hidden, generator=gen).to(device)
    a_stacks = [torch.randn(3, rank, hidden, generator=gen).to(device) for _ in widths]
    b_stacks = [torch.randn(3, w, rank, generator=gen).to(device) for w in widths]
    scale = torch.tensor([2.0, 0.5, 1.0], device=device)
    slots = torch.tensor(SLOTS, device=device)
    qkv = torch.randn(8, sum(widths), generator=gen).to(device)
    before = qkv.clone()
    shrunk = lora_shrink(x, torch.cat(a_stacks, dim=1), slots)
    offset = 0
    for i, (w, b_stack) in enumerate(zip(widths, b_stacks)):
        lora_expand(
            qkv[:, offset : offset + w], shrunk[:, i * rank : (i + 1) * rank], b_stack, slots, scale
        )
        offset += w
    expected = before.clone()
    for t, slot in enumerate(SLOTS):
        if slot >= 0:
            expected[t] += scale[slot] * torch.cat(
                [b[slot] @ (a[slot] @ x[t]) for a, b in zip(a_stacks, b_stacks)]
            )
    torch.testing.assert_close(qkv, expected, **TOL[torch.float32])
    assert torch.equal(qkv[[1, 5]], before[[1, 5]])


def test_all_skipped_and_empty(device):
    y, shrunk, b_stack, slots, scale = _inputs(6, 32, 8, device=device)
    before = y.clone()
    lora_expand(y, shrunk, b_stack, torch.full_like(slots, -1), scale)
    lora_expand(y[:0], shrunk[:0], b_stack, slots[:0], scale)
    assert torch.equal(y, before)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(y=a["y"].int()), "y dtype"),
        (lambda a: a.update(y=a["y"][:, :32]), "b_stack must be"),
        (lambda a: a.update(y=torch.randn(8, 128)[:, ::2]), "y must have a contiguous last dim"),
        (lambda a: a.update(b_stack=a["b_stack"].half()), "b_stack dtype"),
        (lambda a: a.update(b_stack=a["b_stack"][0]), "b_stack must be"),
        (lambda a: a.update(shrunk=a["shrunk"].half()), "shrunk must be float32"),
        (lambda a: a.update(shrunk=a["shrunk"][:, :8]), "shrunk must be"),
        (lambda a: a.update(shrunk=a["shrunk"][:-1]), "shrunk must be"),
        (lambda a: a.update(scale=a["scale"][:2]), "scale must be"),
        (lambda a: a.update(scale=a["scale"].half()), "scale must be"),
        (lambda a: a.update(token_slots=a["token_slots"].float()), "int32/int64"),
        (lambda a: a.update(token_slots=a["token_slots"][:-1]), "token_slots must be"),
    ],
)
def test_launcher_rejects_bad_arguments(mutate, message):
    y, shrunk, b_stack, slots, scale = _inputs(8, 64, 16, slots=SLOTS)
    args = dict(y=y, shrunk=shrunk, b_stack=b_stack, token_slots=slots, scale=scale)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        lora_expand(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_matches_reference(dtype):
    # A prefill-sized step, 4 adapters of rank 64 into a 4096-wide output (a column slice).
    y, shrunk, b_stack, slots, scale = _inputs(
        4096, 4096, 64, num_slots=4, dtype=dtype, device="cuda"
    )
    fused = torch.cat([y, y], dim=1)
    expected = y.clone()
    lora_expand_reference(expected, shrunk, b_stack, slots, scale)
    lora_expand(fused[:, 4096:], shrunk, b_stack, slots, scale)
    torch.testing.assert_close(fused[:, 4096:], expected, **TOL[dtype])
    assert torch.equal(fused[:, :4096], y)
