"""Steps of several requests in one forward on the GPU fast path: lanes over one model.

Contract: `fast_lanes(fast, n)` gives n FastTargets (server/fast_path.py) over one model: `fast`
first, then n-1 more built with its settings. Each lane is a whole backend (server/backend.py) with
a static cache, ring and step buffers of its own; they share the weights (the step kernels' int4
layout, built once), the prefix cache's kept sequences (a lane's last sequence stays live in its
own cache; the engine gives its next turn that lane: server/lane_pool.py, and it goes to the shared
store when the lane takes another prompt), and one `FastBatch`. With n > 1 each lane's
`step` goes through the FastBatch's StepBatcher (server/batcher.py, the CPU path's rendezvous):
the steps that meet run as one forward (`FastBatch.forward_batch`), and every forward and prefill piece of the
lanes holds `FastBatch.lock`, so that prefill pieces interleave with the others' steps and no two
forwards share the GPU's scratch buffers at once.

One forward, several sequences: on the step kernels (CUDA) the steps are stacked
(server/batch_step.py): each padded to the widest one's bucket (the steps that met are split into
as few forwards as fit 64 rows, narrowest together: `stacked_groups`), their rows run every op once, the
per-sequence K/V writes and attention in one launch per layer (the attention's) through a table of
each lane's cache addresses, and the forward is a CUDA graph per (steps, rows) that any lanes
replay. Elsewhere (`FastTarget._forward(..., segments=...)`, the CPU): each lane's rows write and
attend to its own cache (fast_path.Segment), uncaptured. Why outputs do not change: on the step
kernels every op is per row and batch-invariant (server/small_m_matmul.py, the compiled norms, the
step attention's programs per sequence), so a lane's logits are bit for bit those of its step alone.
tests/test_fast_batch.py checks that on CUDA (2 and 8 lanes, captured and not), and on the CPU
(fp32, no step kernels, where row counts change the matmuls' rounding) that the logits are close
and every request's tokens are its solo tokens. A forward takes at most the step kernels' 64
rows: more run in a second forward.

Prompts: an uncached rest short enough to run as steps (a next turn's, `FastTarget.prefill_by_steps`)
joins the shared forwards as steps do; a longer one prefills in pieces under `FastBatch.lock`, the
others' steps running between pieces; its steps are `rows_budget` tokens wide. Drafts:
`FastTarget.shared_room` caps a lane's draft so that its step's bucket is at most its share of
`FastBatch.rows_for(lanes)` rows (16 for one or two lanes in a request, 32 for more; the engine
reads it each step), because stacked steps are padded to the widest one and wider forwards cost
more (E4B on the H200: 4 lanes of 16 rows 2.4x a lone step).

Memory: `plan_fast_memory(..., lanes=n)` fits every lane's cache and buffers and the stacked
forward's scratch under the card or the cap (at one context), or under a cap refuses. The engine
builds lanes on the fast path only when asked (`--parallel N`).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch

from server.batch_step import padded_rows
from server.batcher import StepBatcher
from server.small_m_matmul import MAX_ROWS

ROWS_BUDGET = 16  # rows a shared forward of one or two lanes' steps is filled to (FastBatch.rows_budget)
WIDE_ROWS_BUDGET = 32  # ... of three or more lanes' (FastBatch.rows_for)


class FifoLock:
    """A lock taken in the order it was asked for. threading.Lock queues no one: a lane's thread
    that releases it after a forward and takes it again for the next can keep another lane's
    prefill piece waiting for as long as it has steps. Here each forward or piece waits for those
    asked before it, so a prefill and the running lanes' steps take turns."""

    def __init__(self):
        self._cv = threading.Condition(threading.Lock())
        self._next = self._serving = 0

    def __enter__(self) -> None:
        with self._cv:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cv.wait()

    def __exit__(self, *exc) -> None:
        with self._cv:
            self._serving += 1
            self._cv.notify_all()


class LaneStep:
    """One lane's step, as the StepBatcher carries it (`ids` counts its rows)."""

    __slots__ = ("lane", "ids", "parents")

    def __init__(self, lane, ids: list[int], parents: list[int] | None):
        self.lane, self.parents = lane, parents
        self.ids = np.asarray(ids, dtype=np.int64)


class FastBatch:
    """Runs the steps of several lanes (FastTargets over one model) in shared forwards."""

    def __init__(self, lanes: list):
        if len({(lane.ple_staged, lane.embed_staged) for lane in lanes}) > 1:  # a forward stages all its rows or none
            raise ValueError("lanes whose host tables are looked up in different ways cannot share forwards")
        self.lock = FifoLock()  # one forward or prefill piece of any lane at a time, in turn
        self.max_rows = MAX_ROWS if lanes[0].step_kernels else 1 << 30
        # Rows the lanes' drafts and prompt steps fill a forward with (FastTarget.shared_room,
        # _prefill_by_steps): where a forward still costs about one step (E4B on the H200: 16 rows
        # 1.06x one, 2 lanes x 16 rows 1.3x, 4 x 16 2.4x; bench.gpu_concurrency --rows measures it).
        self.rows_budget = min(ROWS_BUDGET, lanes[0].max_bucket)
        self.wide_rows_budget = max(self.rows_budget, min(WIDE_ROWS_BUDGET, self.max_rows))
        self.batcher = StepBatcher(self)  # calls forward_batch with the steps that met
        # On the step kernels: the steps of a forward stacked, one launch per op, captured as graphs
        # (server/batch_step.py). Elsewhere (the CPU, tests): one Segment per step (_run_segments).
        self.cuda = lanes[0].device.type == "cuda"
        self.forward_s, self.forwards_run = 0.0, 0  # every forward's time (host work and GPU), summed
        self.stacked = None
        if lanes[0].step_kernels and self.cuda:
            from server.batch_step import StackedStep
            self.stacked = StackedStep(lanes)

    def rows_for(self, lanes: int) -> int:
        """Rows the drafts of `lanes` lanes in a request fill a shared forward with (each lane takes
        an equal share: FastTarget.shared_room). One or two lanes: `rows_budget`, where a forward
        costs about a lone step. Three or more: `wide_rows_budget`, a second tile of 16 rows: a share
        of 16 rows would then be a draft of 3 tokens at 4 lanes and 1 at 8, and the tokens the wider
        shares add outweigh what the second tile costs the forward. Measured on the H200, E4B shape
        (python -m bench.gpu_concurrency --turn 64, --rows 16 against --rows 32, one sitting): 4
        streams 2.25x one stream's tokens/s -> 2.44x and p50 1.70x solo -> 1.61x, 8 streams 2.66x ->
        3.15x; 2 streams 1.63x with 16 rows, 1.55x with 32."""
        return shared_rows(lanes, self.rows_budget, self.wide_rows_budget)

    def join(self) -> None:
        """A lane's request started: steps wait for it (a while) before their forward runs."""
        self.batcher.join()

    def leave(self) -> None:
        self.batcher.leave()

    def step(self, lane, ids: list[int], parents: list[int] | None) -> torch.Tensor:
        """The lane's step logits, from a forward that may carry other lanes' steps. A step that
        cannot run (too many tokens, past the cache) is refused here, before it joins a forward
        that other lanes' steps share."""
        lane._check_room(lane.pos + lane._bucket(len(ids)))
        logits, lane._others = self.batcher.run(LaneStep(lane, ids, parents))
        return logits

    @torch.no_grad()
    def forward_batch(self, steps: list[LaneStep]) -> list[torch.Tensor]:
        """Each step's logits [its tokens, vocab], in order; as many forwards as the rows need.
        `last_forward_s`: their time, without waiting for the lock (the batcher's linger reads it)."""
        self.last_forward_s = 0.0
        out: list[torch.Tensor | None] = [None] * len(steps)
        widths = [s.lane._bucket(len(s.ids)) for s in steps]
        for group in (stacked_groups(widths, self.max_rows) if self.stacked is not None
                      else summed_groups(widths, self.max_rows)):
            self._run(steps, group, out)
        return out

    def _run(self, steps: list[LaneStep], group: list[int], out: list) -> None:
        with self.lock:
            t0 = time.perf_counter()
            try:
                self._run_locked(steps, group, out)
                if self.cuda:
                    # Done when the GPU is: a graph replay returns at once, and the batcher's linger
                    # (about one forward) would otherwise be a launch's time, shorter than a lane's
                    # wait for its logits: measured on the H200, 2 streams then never shared a forward.
                    torch.cuda.synchronize()
            finally:  # the forward's own time, not the wait for a prefill piece (the batcher's linger)
                seconds = time.perf_counter() - t0
                self.last_forward_s += seconds
                self.forward_s += seconds
                self.forwards_run += 1

    def _run_locked(self, steps: list[LaneStep], group: list[int], out: list) -> None:
        if len(group) == 1:  # alone: the lane's own path (its captured graphs on CUDA)
            s = steps[group[0]]
            out[group[0]] = s.lane.step_alone(s.ids.tolist(), s.parents)
            return
        mine = [steps[i] for i in group]
        T = max(s.lane._bucket(len(s.ids)) for s in mine)
        if self.stacked is not None and self.stacked.fits(mine, T):
            for i, logits in zip(group, self.stacked.run(mine, T)):
                out[i] = logits
            return
        self._run_segments(steps, group, out)

    def _run_segments(self, steps: list[LaneStep], group: list[int], out: list) -> None:
        """One forward, one Segment per step, each padded to its own bucket (uncaptured)."""
        from server.fast_path import Segment

        segments, lo = [], 0
        for i in group:
            s = steps[i]
            n, T, kv_len = s.lane._stage_step(s.ids.tolist(), s.parents)
            segments.append(Segment(s.lane, lo, lo + T, kv_len))
            lo += T
        leader = steps[group[0]].lane
        ids = torch.cat([seg.target.ids_buf[:seg.hi - seg.lo] for seg in segments])
        pos = torch.cat([seg.target.pos_buf[:seg.hi - seg.lo] for seg in segments])
        ple = (torch.cat([seg.target.ple_buf[:seg.hi - seg.lo] for seg in segments])
               if leader.ple_staged else None)
        embed = (torch.cat([seg.target.embed_buf[:seg.hi - seg.lo] for seg in segments])
                 if leader.embed_staged else None)
        logits = leader._forward(ids, pos, None, step=True, segments=segments, ple_rows=ple, embed_rows=embed)
        for i, seg in zip(group, segments):
            s = steps[i]
            s.lane._after_step(s.ids.tolist(), s.parents, seg.hi - seg.lo)
            out[i] = logits[seg.lo:seg.lo + len(s.ids)]


def shared_rows(lanes: int, rows_budget: int = ROWS_BUDGET, wide_rows_budget: int = WIDE_ROWS_BUDGET) -> int:
    """FastBatch.rows_for's rule: `rows_budget` for one or two lanes, `wide_rows_budget` for more."""
    return rows_budget if lanes <= 2 else wide_rows_budget


def summed_groups(widths: list[int], max_rows: int) -> list[list[int]]:
    """Steps (their buckets' widths) into forwards in order, each step taking its own rows (the
    uncaptured segments), at most `max_rows` a forward (a step alone may exceed it)."""
    groups: list[list[int]] = []
    total = 0
    for i, width in enumerate(widths):
        if groups and total + width <= max_rows:
            groups[-1].append(i)
            total += width
        else:
            groups.append([i])
            total = width
    return groups


def stacked_groups(widths: list[int], max_rows: int) -> list[list[int]]:
    """Steps (their buckets' widths) into stacked forwards: every step of a forward is padded to the
    widest one's rows, at most `max_rows` rows a forward. Fewest forwards first (a forward costs
    about a lone step whatever it carries: E4B on the H200, 16 rows 4.7 ms, 32 rows 6.0-6.9 ms, 64
    rows about 10), then fewest rows computed (the power of two at or above them, batch_step's
    `padded_rows`). The steps are taken narrowest first and each forward is a run of that order, so a
    prompt's 16-token step no longer pads 15 lanes' 2-token steps to 16 rows (64 rows, 4 lanes, a
    forward: 4 forwards where 2 do)."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    # best[j]: (forwards, rows computed, where the last forward starts) for the first j steps of order
    best: list[tuple[int, int, int]] = [(0, 0, 0)] + [(1 << 30, 0, 0)] * len(order)
    for j in range(1, len(order) + 1):
        width = widths[order[j - 1]]  # the widest of any run ending at j
        for i in range(j - 1, -1, -1):
            if (j - i) * width > max_rows and i < j - 1:
                break  # longer runs only add rows
            forwards, rows, _ = best[i]
            candidate = (forwards + 1, rows + padded_rows(min((j - i) * width, max_rows)), i)
            if candidate[:2] < best[j][:2]:
                best[j] = candidate
    groups: list[list[int]] = []
    j = len(order)
    while j > 0:
        i = best[j][2]
        groups.append(order[i:j])
        j = i
    return groups[::-1]


def fast_lanes(fast, n: int) -> list:
    """n lanes over `fast`'s model (see the module docstring); [fast] alone for n <= 1."""
    if n <= 1:
        return [fast]
    from server.fast_path import FastTarget

    if fast.device.type == "cuda" and not fast.step_kernels:
        raise ValueError(f"lanes need the batch-invariant step kernels ({fast.step_kernel_note}): without them a "
                         "request's output would depend on the requests beside it")

    # The others prefill through the shared dequantization scratch (bit for bit what a dense copy
    # gives: tests/test_small_m_layout.py): one dense copy of the weights is enough for the card.
    settings = dict(fast.settings, prefill_dense=False)
    if fast.ple_on_host or fast.embed_on_host:  # the lanes look their rows up as the first does (FastBatch checks)
        settings["map_host_tables"] = not (fast.ple_staged or fast.embed_staged)
    lanes = [fast] + [FastTarget(fast.model, **settings, prefix_store=fast.store) for _ in range(n - 1)]
    for lane in lanes[1:]:
        lane.warmup()  # its own graphs, as the first lane's were captured at start-up
    batch = FastBatch(lanes)
    for lane in lanes:
        lane.batch = batch
    return lanes
