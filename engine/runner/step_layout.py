"""One step laid out as the model runner's forward sees it: `build_layout` turns a
SchedulerOutput into a StepLayout (the ragged batch's arrays and which rows sample, record
prompt logprobs, pool or verify drafts); engine/runner/model_runner.py runs the forward over it and
collects the step's RunnerOutput from it.

Row order (AttentionMetadata invariant): one-token (decode) rows first, then every other
request's rows, request after request; rows of one request are consecutive."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.core.request import Request
from engine.core.scheduler_output import SchedulerOutput
from engine.kv.block_manager import BlockManager
from engine.parallel.step import GroupArrays, StepInputs, attention_metadata
from engine.runner.pooler import Pooler
from engine.sampling.sample_row import SampleRow


@dataclass(slots=True)
class Verify:
    """A request that verifies `drafts` this step; its sample rows are `first` ..
    `first + len(drafts)` (every draft position and the one after the last draft)."""

    request: Request
    first: int
    drafts: list[int]
    probs: torch.Tensor | None  # the drafts' distributions, where the proposer gave them

    @property
    def rows(self) -> range:
        return range(self.first, self.first + len(self.drafts) + 1)


@dataclass(slots=True)
class StepLayout:
    """What the runner needs of one step, built once (`build_layout`)."""

    order: list[tuple[Request, int]]  # (request, tokens), decode rows first
    inputs: StepInputs  # the forward's arrays (what tensor-parallel ranks receive)
    num_decodes: int  # requests with one row, first in `order`
    sample_at: list[int] = field(default_factory=list)  # batch row of each sample row
    sample_rows: list[SampleRow] = field(default_factory=list)
    prompt_spans: list[tuple[Request, int, int]] = field(default_factory=list)
    """(request, first position, end): prompt positions whose logprobs this step records."""
    prompt_rows: list[int] = field(default_factory=list)  # their batch rows, in order
    pool_spans: list[tuple[Request, int]] = field(default_factory=list)
    """(pooling request, how many of its rows it pools here)."""
    pool_rows: list[int] = field(default_factory=list)  # their batch rows, in order
    verify: list[Verify] = field(default_factory=list)

    @property
    def all_decode(self) -> bool:
        """Only plain decode rows: what a CUDA graph replays (no LoRA check here)."""
        return (
            self.num_decodes == len(self.order)
            and not self.prompt_rows
            and not self.verify
            and not self.pool_spans
        )


class _Rows:
    """The per-row accumulators while a step is laid out (one `add` per request)."""

    def __init__(self, output: SchedulerOutput, bm: BlockManager, pooler: Pooler) -> None:
        self.output, self.bm, self.pooler = output, bm, pooler
        self.block_size = bm.block_size
        self.groups = range(bm.num_groups)
        # Decode rows as flat ints (one array each at the end); other rows one array per
        # request after them.
        self.decode_ids: list[int] = []
        self.decode_positions: list[int] = []
        self.decode_slots: list[list[int]] = [[] for _ in self.groups]
        self.input_ids: list[list[int]] = []
        self.positions: list[np.ndarray] = []
        self.slots: list[list[np.ndarray]] = [[] for _ in self.groups]
        self.tables: list[list[list[int]]] = [[] for _ in self.groups]
        self.query_lens: list[int] = []
        self.seq_lens: list[int] = []
        self.row = 0  # the next batch row
        self.sample_at: list[int] = []
        self.sample_rows: list[SampleRow] = []
        self.prompt_spans: list[tuple[Request, int, int]] = []
        self.prompt_rows: list[int] = []
        self.pool_spans: list[tuple[Request, int]] = []
        self.pool_rows: list[int] = []
        self.verify: list[Verify] = []

    def add(self, request: Request, n: int) -> None:
        start = request.num_computed_tokens
        drafts = self.output.drafts_of(request)
        group_tables = self.bm.block_tables(request.request_id)
        if n == 1:  # a decode row: plain ints (no per-row arrays)
            self.decode_ids.append(request.token_ids[start])
            self.decode_positions.append(start)
            block, offset = divmod(start, self.block_size)
            for g in self.groups:
                self.decode_slots[g].append(group_tables[g][block] * self.block_size + offset)
        else:
            pos = np.arange(start, start + n)
            self.input_ids.append(request.token_ids[start : start + n - len(drafts)] + drafts)
            self.positions.append(pos)
            for g in self.groups:
                self.slots[g].append(slots_of(group_tables[g], pos, self.block_size))
        for g in self.groups:
            self.tables[g].append(group_tables[g])
        self.query_lens.append(n)
        self.seq_lens.append(start + n)
        self._add_outputs(request, start, n)
        self.row += n
        self._add_samples(request, start, n, drafts)

    def _add_outputs(self, request: Request, start: int, n: int) -> None:
        """The rows a pooling request pools, or a prompt-logprobs request records."""
        layout, row = self, self.row
        if request.pooling is not None:
            rows = self.pooler.rows(request, start, n)
            if rows:
                layout.pool_spans.append((request, len(rows)))
                layout.pool_rows.extend(range(row + rows.start - start, row + rows.stop - start))
        elif request.sampling.prompt_logprobs is not None:
            # Position p predicts prompt token p + 1; skip positions already recorded
            # (recomputed after a preemption) and the last prompt position (it samples).
            first = max(start, len(request.prompt_logprobs))
            end = min(start + n, request.num_prompt_tokens - 1)
            if first < end:
                layout.prompt_spans.append((request, first, end))
                layout.prompt_rows.extend(range(row + first - start, row + end - start))

    def _add_samples(self, request: Request, start: int, n: int, drafts: list[int]) -> None:
        """Sample rows, after the request's rows are laid out (`self.row` is past them)."""
        layout, last = self, self.row - 1
        if drafts:  # verify: every draft position and the one after the last draft
            probs = self.output.drafts[request.request_id].probs
            layout.verify.append(Verify(request, len(layout.sample_rows), drafts, probs))
            for j in range(len(drafts) + 1):
                layout.sample_at.append(last - len(drafts) + j)
                layout.sample_rows.append(
                    SampleRow(request, request.completion_index, tuple(drafts[:j]))
                )
        elif start + n == request.num_tokens and request.pooling is None:  # draw the next
            for index in range(request.sampling.n if request.pending_forks else 1):
                layout.sample_at.append(last)
                layout.sample_rows.append(SampleRow(request, index or request.completion_index))

    def finish(self, order: list[tuple[Request, int]]) -> StepLayout:
        logits_rows = self.sample_at + self.prompt_rows  # none: no LM head this step
        inputs = StepInputs(
            np.concatenate([_flat(self.decode_ids), *self.input_ids]).astype(np.int64, copy=False),
            np.concatenate([_flat(self.decode_positions), *self.positions]).astype(
                np.int64, copy=False
            ),
            [
                GroupArrays.build([_flat(self.decode_slots[g]), *self.slots[g]], self.tables[g])
                for g in self.groups
            ],
            self.query_lens,
            self.seq_lens,
            _flat(logits_rows) if logits_rows else None,
        )
        return StepLayout(
            order,
            inputs,
            len(self.decode_ids),
            self.sample_at,
            self.sample_rows,
            self.prompt_spans,
            self.prompt_rows,
            self.pool_spans,
            self.pool_rows,
            self.verify,
        )


def build_layout(output: SchedulerOutput, bm: BlockManager, pooler: Pooler) -> StepLayout:
    """The step's rows: one-token rows first (backends batch them), then the rest in
    scheduling order; a request's drafts (`output.drafts`) follow its last token."""
    order = sorted(output.scheduled, key=lambda item: item[1] != 1)
    rows = _Rows(output, bm, pooler)
    for request, n in order:
        rows.add(request, n)
    return rows.finish(order)


def batch_metadata(
    device: torch.device,
    slots: list[np.ndarray],
    tables: list[list[int]],
    query_lens: list[int],
    seq_lens: list[int],
) -> AttentionMetadata:
    """AttentionMetadata of a ragged batch laid out sequence after sequence (one-token
    sequences first: the caller orders them so)."""
    return attention_metadata(device, GroupArrays.build(slots, tables), query_lens, seq_lens)


def slots_of(table: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """KV slots (block_id * block_size + offset) of `positions` in a block table."""
    return np.asarray(table)[positions // block_size] * block_size + positions % block_size


def _flat(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)
