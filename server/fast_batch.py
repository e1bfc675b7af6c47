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

One forward, several sequences (`FastTarget._forward(..., segments=...)`): the rows of every lane's
step (each padded to its own bucket) are stacked; embedding, every matmul, the norms and the LM head
run once over all rows, and each lane's rows write and attend to its own cache (fast_path.Segment).
Why outputs do not change: on the step kernels every one of those is per row and batch-invariant
(server/small_m_matmul.py, the compiled norms, server/step_attention.py run per lane), so a lane's
logits are bit for bit those of its step alone. tests/test_fast_batch.py checks that on CUDA (a
test written, not yet run on a GPU), and on the CPU (fp32, no step kernels, where row counts change
the matmuls' rounding) that the logits are close and every request's tokens are its solo tokens. A
forward takes at most the step kernels' 64 rows: more run in a second forward.

Memory: `plan_fast_memory(..., lanes=n)` fits every lane's cache and buffers under the card or the
cap (at one context), or under a cap refuses. Not yet: CUDA graphs of the batched forward (a lone step still
replays its lane's graphs; a batched one runs uncaptured, about 700 launches from the host on the
E4B shape, so it pays only when it replaces several lone steps: unmeasured), and any GPU
measurement. The engine builds lanes on the fast path only when asked (`--parallel N`).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch

from server.batcher import StepBatcher
from server.small_m_matmul import MAX_ROWS


class LaneStep:
    """One lane's step, as the StepBatcher carries it (`ids` counts its rows)."""

    __slots__ = ("lane", "ids", "parents")

    def __init__(self, lane, ids: list[int], parents: list[int] | None):
        self.lane, self.parents = lane, parents
        self.ids = np.asarray(ids, dtype=np.int64)


class FastBatch:
    """Runs the steps of several lanes (FastTargets over one model) in shared forwards."""

    def __init__(self, lanes: list):
        self.lock = threading.RLock()  # one forward or prefill piece of any lane at a time
        self.max_rows = MAX_ROWS if lanes[0].step_kernels else 1 << 30
        self.batcher = StepBatcher(self)  # calls forward_batch with the steps that met

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
        return self.batcher.run(LaneStep(lane, ids, parents))[0]

    @torch.no_grad()
    def forward_batch(self, steps: list[LaneStep]) -> list[torch.Tensor]:
        """Each step's logits [its tokens, vocab], in order; as many forwards as the rows need.
        `last_forward_s`: their time, without waiting for the lock (the batcher's linger reads it)."""
        self.last_forward_s = 0.0
        out: list[torch.Tensor | None] = [None] * len(steps)
        group: list[int] = []
        rows = 0
        for i, s in enumerate(steps):
            need = s.lane._bucket(len(s.ids))
            if group and rows + need > self.max_rows:
                self._run(steps, group, out)
                group, rows = [], 0
            group.append(i)
            rows += need
        if group:
            self._run(steps, group, out)
        return out

    def _run(self, steps: list[LaneStep], group: list[int], out: list) -> None:
        with self.lock:
            t0 = time.perf_counter()
            try:
                self._run_locked(steps, group, out)
            finally:  # the forward's own time, not the wait for a prefill piece (the batcher's linger)
                self.last_forward_s += time.perf_counter() - t0

    def _run_locked(self, steps: list[LaneStep], group: list[int], out: list) -> None:
        from server.fast_path import Segment

        if len(group) == 1:  # alone: the lane's own path (its captured graphs on CUDA)
            s = steps[group[0]]
            out[group[0]] = s.lane.step_alone(s.ids.tolist(), s.parents)
            return
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
               if leader.ple_on_host else None)
        logits = leader._forward(ids, pos, None, step=True, segments=segments, ple_rows=ple)
        for i, seg in zip(group, segments):
            s = steps[i]
            s.lane._after_step(s.ids.tolist(), s.parents, seg.hi - seg.lo)
            out[i] = logits[seg.lo:seg.lo + len(s.ids)]


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
    lanes = [fast] + [FastTarget(fast.model, **settings, prefix_store=fast.store) for _ in range(n - 1)]
    for lane in lanes[1:]:
        lane.warmup()  # its own graphs, as the first lane's were captured at start-up
    batch = FastBatch(lanes)
    for lane in lanes:
        lane.batch = batch
    return lanes
