"""CUDA graphs for decode steps (vLLM's `cudagraph_capture_sizes` idea).

A decode step of a small model on a GPU is mostly kernel launches: hundreds of them, each a
few microseconds of host time for a kernel that runs for less. A CUDA graph records one
forward's launches once and replays them with one call. It replays exactly what it recorded
(the same buffers, the same launch grids), so:

- Every graph reads its inputs from static buffers owned here (token ids, positions, per KV
  group slots and block tables, context lengths) and writes its logits to a static output;
  a step copies its inputs in, replays, and reads the first `n` rows out.
- A step of `n` decode rows replays the graph of the smallest captured size `>= n`. The
  padding rows store nothing (slot -1) and attend over one key of a block the pool has:
  harmless reads whose results are dropped.
- The attention launch plan is made for the longest context the engine admits
  (`max_model_len`), so one graph serves every context length: split-KV partitions past a
  row's length see no keys (what a mixed-length eager batch does already).

Captured lazily, per size, the first time a step needs it (or all at once by `capture_all`,
the serving worker's warm-up), into one memory pool shared by every size. Capturing stores
nothing in the KV pool (every slot is -1), so it is safe at any time between steps. Graphs
hold raw pointers to the weights and the pool: `drop` them when either is reallocated
(sleep / wake, engine/lifecycle.py); the next steps capture again.

What a graph cannot do runs eagerly (the runner decides, ModelRunner.execute): prefill
chunks, mixed steps, speculative verification, pooling, prompt logprobs, LoRA, tensor
parallelism, the torch attention backend (its Python loops read the host copies of the
lengths) and batches larger than the largest size. If a capture fails (a model whose forward
synchronises with the host, say), graphs are off for the engine's life and `disabled` says why.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.checks import FieldError
from engine.config import EngineConfig
from engine.models.interface import CausalLM, ForwardContext
from engine.parallel.step import StepInputs

log = logging.getLogger(__name__)

Replay = Callable[[], None]
Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Replay, torch.Tensor, object]]
"""(forward, pool) -> (replay, the forward's output as captured, the pool for the next capture)."""


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default shape: 1, 2, 4, then every multiple of 8, up to `max_num_seqs` (and
    `max_num_seqs` itself, so that every admissible decode batch has a graph)."""
    sizes = {s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs}
    return tuple(sorted(sizes | {max_num_seqs}))


def decode_graphs(
    config: EngineConfig,
    model: CausalLM,
    backend: AttentionBackend,
    kv_cache: torch.Tensor,
    num_groups: int,
    max_model_len: int,
) -> DecodeGraphs | None:
    """An engine's decode graphs: on CUDA with the Triton backend and one rank, unless
    `enforce_eager`; the sizes from `cuda_graph_sizes`, else the default. Sizes given for an
    engine that captures none are refused (EngineConfig refuses them with enforce_eager and
    tensor parallelism; the device and backend are known here)."""
    if config.enforce_eager or config.parallel:
        return None
    if kv_cache.device.type != "cuda" or backend.name != "triton":
        if config.cuda_graph_sizes:
            where = (
                "the CPU"
                if kv_cache.device.type != "cuda"
                else f"the {backend.name} attention backend"
            )
            raise FieldError(
                "cuda_graph_sizes",
                f"cuda_graph_sizes: decode steps on {where} run "
                "eagerly (CUDA graphs need CUDA and the triton backend)",
            )
        return None
    sizes = config.cuda_graph_sizes or default_capture_sizes(config.max_num_seqs)
    return DecodeGraphs(model, backend, kv_cache, num_groups, max_model_len, sizes)


def cuda_capture(forward: Callable[[], torch.Tensor], pool) -> tuple[Replay, torch.Tensor, object]:
    """Record `forward` into a CUDA graph: one eager run first on a side stream (Triton's
    compiles and the allocator's first blocks must not happen during the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph.replay, out, graph.pool()


class DecodeGraphs:
    """Captured decode forwards by batch size, and the static buffers they read."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        num_groups: int,
        max_model_len: int,
        sizes: Sequence[int],
        capture: Capture = cuda_capture,
    ) -> None:
        """`capture`: how a forward is recorded (`cuda_capture`; tests on the CPU pass one
        that re-runs the forward on replay)."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be >= 1, got {list(sizes)}")
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        self._capture = capture
        device, most = kv_cache.device, self.sizes[-1]
        width = -(-max_model_len // kv_cache.shape[4])  # blocks of the longest context
        self.input_ids = torch.zeros(most, dtype=torch.int64, device=device)
        self.positions = torch.zeros(most, dtype=torch.int64, device=device)
        self.slots = [
            torch.full((most,), -1, dtype=torch.int64, device=device) for _ in range(num_groups)
        ]
        self.tables = [
            torch.zeros((most, width), dtype=torch.int32, device=device) for _ in range(num_groups)
        ]
        self.seq_lens = torch.ones(most, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(most + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(most, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[Replay, torch.Tensor]] = {}
        self._pool: object = None  # the graphs' shared memory pool, once one is captured
        self.disabled: str | None = None
        """Why graphs are off for good (a failed capture), else None."""

    def size_for(self, step: StepInputs) -> int | None:
        """The captured size this all-decode step replays, or None (it runs eagerly)."""
        n = step.num_tokens
        if self.disabled is not None or n > self.sizes[-1] or step.logits_rows is None:
            return None
        if any(g.block_tables.shape[1] > self.tables[0].shape[1] for g in step.groups):
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def logits(self, step: StepInputs) -> torch.Tensor | None:
        """fp32 logits at `step.logits_rows` for a step of one-token rows only, through its
        graph (captured now if it is the first of its size); None: run it eagerly."""
        size = self.size_for(step)
        if size is None:
            return None
        graph = self._graphs.get(size) or self._record(size)
        if graph is None:
            return None
        replay, out = graph
        self._fill(step, size)
        replay()
        rows = step.logits_rows
        n = step.num_tokens
        assert rows is not None  # a decode step samples every row
        if len(rows) == n and bool(np.array_equal(rows, np.arange(n))):
            return out[:n]
        return out[torch.from_numpy(rows).to(out.device)]

    def capture_all(self) -> None:
        """Every size now, largest first (the shared pool grows once)."""
        for size in reversed(self.sizes):
            if self.disabled is not None:
                return
            if size not in self._graphs:
                self._record(size)

    def drop(self) -> None:
        """Forget every graph (the weights or the pool moved); later steps capture again."""
        self._graphs.clear()
        self._pool = None

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def _fill(self, step: StepInputs, size: int) -> None:
        n = step.num_tokens
        self.input_ids[:n].copy_(torch.from_numpy(step.input_ids))
        self.positions[:n].copy_(torch.from_numpy(step.positions))
        self.seq_lens[:n].copy_(torch.tensor(step.seq_lens, dtype=torch.int32))
        for group, slots, tables in zip(step.groups, self.slots, self.tables):
            slots[:n].copy_(torch.from_numpy(group.slot_mapping))
            tables[:n, : group.block_tables.shape[1]].copy_(torch.from_numpy(group.block_tables))
        # Padding rows: store nothing, attend over one key. Their table rows keep block ids
        # the pool has (zeros, or an earlier step's), so the read stays in the pool.
        if n < size:
            self.seq_lens[n:size].fill_(1)
            for slots in self.slots:
                slots[n:size].fill_(-1)

    def _metadata(self, size: int) -> list[AttentionMetadata]:
        return [
            AttentionMetadata(
                slot_mapping=slots[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
                block_tables=tables[:size],
                query_lens_cpu=[1] * size,
                seq_lens_cpu=[self.max_model_len] * size,
                num_decodes=size,
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
            for slots, tables in zip(self.slots, self.tables)
        ]

    def _record(self, size: int) -> tuple[Replay, torch.Tensor] | None:
        metadata = self._metadata(size)  # one object: the backend plans once, at capture

        def forward() -> torch.Tensor:
            ctx = ForwardContext.for_groups(self.backend, self.kv_cache, metadata)
            x = self.model.residual(self.input_ids[:size], self.positions[:size], ctx)
            return self.model.logits(x, ctx, self.rows[:size])

        self.seq_lens[:size].fill_(1)
        for slots in self.slots:
            slots[:size].fill_(-1)  # the capture's own runs store nothing
        try:
            replay, out, self._pool = self._capture(forward, self._pool)
        except Exception as e:  # noqa: BLE001 - any failure: eager for good, saying why
            self.disabled = f"{type(e).__name__}: {e}"
            self.drop()
            log.warning(
                "CUDA graph capture failed at batch size %d, decode runs eagerly: %s",
                size,
                self.disabled,
            )
            return None
        self._graphs[size] = (replay, out)
        return replay, out
