"""Several lanes' steps as one forward on the step kernels: stacked rows, one launch per op, graphs.

Contract: `StackedStep(lanes)` serves the lanes (FastTargets over one model with the step kernels on
CUDA: server/fast_batch.py) of one FastBatch. `run(steps, T)` takes S steps (lane, ids, parents) of
different lanes, pads each to T rows (a step bucket at least each one's own), runs one forward and
returns each step's logits [its tokens, vocab], leaving each lane as its own step would (cache
written, position advanced, prefix cache told). `fits(steps, T)`: every lane has room for T rows.
The forward's rows are padded to a power of two (`padded_rows`): rows past S*T belong to no segment.

How: segment s's rows are rows s*T..s*T+T-1 of the forward. Their ids, positions and where they
write sit in one staging buffer, with one row of int64 addresses per segment (its K/V caches,
ring positions, tree paths: the table). The per-sequence work runs once for all segments: one
kernel a forward scatters the ring positions through the table, and server/step_attention.py's
`segments` runs every segment's attention in one launch a layer of the lone kernels' programs,
which also writes each segment's new K/V rows into its caches. So a forward of S steps launches
what one step does, and the forward is captured once per (S, T) as a CUDA graph that reads the
staging buffer: any S lanes, in any order, at any context, replay it. Full layers read up to the cache's end (kv_len = max_len: step attention skips
the chunks past each query's position, so a larger kv_len reads the same keys in the same order).

Why each lane's logits are its step's alone, bit for bit: the matmuls and norms are per row and
batch-invariant (server/small_m_matmul.py, the compiled norms), each segment's attention is the
lone kernel's programs on its own cache, and padding a step to a larger bucket adds rows no real
row sees (rows attend to positions up to their own; a padded row writes past the step, where
the next step writes before anything reads, and the ring holds a bucket more than the window).
tests/test_fast_batch.py checks it on CUDA for 2 and 8 lanes against each lane alone (tiny model);
tests/test_stacked_step_interpreted.py checks the kernels under Triton's interpreter and
tests/test_stacked_step_ptx.py their load widths in the sm_90 PTX; bench.gpu_concurrency measures
the E4B shape.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from server.sampling import with_argmax
from server.small_m_matmul import MAX_ROWS

_IDS, _POS, _WPOS, _RING = range(4)  # staging rows of MAX_ROWS int64 each; the table follows


class StackedStep:
    def __init__(self, lanes: list):
        from server.step_attention import StepAttention

        self.lanes = lanes
        lead = self.lead = lanes[0]
        dev = lead.device
        self.owners = sorted(lead.k_cache)               # cache-owning layers, in table order
        self.k_field = {index: 2 * j for j, index in enumerate(self.owners)}
        self.slot_pos_field, self.path_field = 2 * len(self.owners), 2 * len(self.owners) + 1
        self.width = 2 * len(self.owners) + 2
        for lane in lanes:  # each lane's table row: the addresses its segment reads and writes
            lane.table_row = np.array(
                [t.data_ptr() for index in self.owners for t in (lane.k_cache[index], lane.v_cache[index])]
                + [lane.slot_pos.data_ptr(), lane.path_buf.data_ptr()], dtype=np.int64)
        size = 4 * MAX_ROWS + len(lanes) * self.width
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        # Staged through numpy views of the pinned rows: a forward's staging is a few writes per
        # lane, and a numpy write costs a fraction of a torch op's dispatch (16 lanes' staging took
        # 2.6 ms of a 9 ms forward with torch ops on the H200).
        self.host_np = self.host.numpy()
        self.host_rows = self.host_np[:4 * MAX_ROWS].reshape(4, MAX_ROWS)
        self.host_ids = self.host[:4 * MAX_ROWS].view(4, MAX_ROWS)[_IDS]  # as a tensor: the host row tables gather by it
        self.staged = torch.zeros(size, dtype=torch.int64, device=dev)
        rows = self.staged[:4 * MAX_ROWS].view(4, MAX_ROWS)
        self.ids, self.pos, self.wpos, self.ring_slot = rows[_IDS], rows[_POS], rows[_WPOS], rows[_RING]
        self.table = self.staged[4 * MAX_ROWS:].view(len(lanes), self.width)
        # rows of tables kept on the host that the GPU cannot read in place, staged before each replay
        # (a mapped table is read inside the graph: server/host_rows.py)
        self.ple = (torch.zeros(MAX_ROWS, lead.embed_ple.width, dtype=lead.embed_ple.dtype, device=dev)
                    if lead.ple_staged else None)
        self.embed_rows = (torch.zeros(MAX_ROWS, lead.embed.width, dtype=lead.embed.dtype, device=dev)
                           if lead.embed_staged else None)
        self.attention = {d: StepAttention(a.kv_heads, a.group, d, a.n_chunks * a.block_s, MAX_ROWS, dev)
                          for d, a in lead.step_attention.items()}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # by (S, T)
        from server.small_m_matmul import pdl_launch
        self.launch = pdl_launch(dev)
        self.capture_s = 0.0
        self.capture_by_key: dict[str, float] = {}
        self.runs = self.replays = 0
        self.staging_s = 0.0  # host time staging the replayed forwards' inputs, summed

    def fits(self, steps: list, T: int) -> bool:
        return len(steps) * T <= MAX_ROWS and all(s.lane.pos + T <= s.lane.max_len for s in steps)

    @torch.no_grad()
    def run(self, steps: list, T: int) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        S = len(steps)
        self.runs += 1
        rows, table = self.host_rows, self.host_np[4 * MAX_ROWS:]
        ids = [step.ids.tolist() for step in steps]
        ns = []
        for s, step in enumerate(steps):
            lane, lo = step.lane, s * T
            n, _ = lane._stage_host(ids[s], step.parents, T)
            ns.append(n)
            rows[_IDS:_POS + 1, lo:lo + T] = lane._host_np[:2, :T]  # ids and positions (_IDS, _POS)
            wpos = rows[_WPOS, lo:lo + T]
            np.add(lane._rows_np[:T], lane.pos, out=wpos)
            np.remainder(wpos, lane.ring, out=rows[_RING, lo:lo + T])
            table[s * self.width:(s + 1) * self.width] = lane.table_row
        R = padded_rows(S * T)
        rows[:, S * T:R] = 0  # rows of no segment (position 0): computed, written nowhere, read by no one
        used = 4 * MAX_ROWS + S * self.width
        self.staged[:used].copy_(self.host[:used])
        if self.ple is not None:  # the per-layer rows, gathered on the host
            self.lead.embed_ple.rows_into(self.host_ids[:R], self.ple[:R])
        if self.embed_rows is not None:
            self.lead.embed.rows_into(self.host_ids[:R], self.embed_rows[:R])
        if self.lead.capture:
            self.staging_s += time.perf_counter() - t0  # the host's work before the GPU's (a replay's)
            graph, out = self._graph(S, T)
            graph.replay()
            self.replays += 1
            logits = out.clone()  # the lanes read their rows after the next forward may have run
        else:
            logits = self._forward(S, T)
        for s, step in enumerate(steps):
            step.lane._after_step(ids[s], step.parents, T)
        return self.lanes_logits(logits, ns, T)

    @staticmethod
    def lanes_logits(logits: torch.Tensor, ns: list[int], T: int) -> list[torch.Tensor]:
        """Each segment's rows of the forward's logits, carrying their argmax (server/sampling.py
        `with_argmax`): every row's in one launch and one copy back, which waits for the forward,
        where each lane asking for its own rows' would cost a launch and a wait per lane, one
        after another under the GIL."""
        best = logits.argmax(-1).tolist()
        return [with_argmax(logits[s * T:s * T + n], best[s * T:s * T + n]) for s, n in enumerate(ns)]

    def _forward(self, S: int, T: int) -> torch.Tensor:
        # Every segment's full layers read up to the cache's end: step attention skips the chunks
        # past each row's position (the same keys, the same order), and one graph per (S, T) serves
        # every context, not one per kv_len bucket (each capture costs a forward and more).
        R, kv_len = padded_rows(S * T), self.lead.max_len
        return self.lead._forward(self.ids[:R], self.pos[:R], kv_len, step=True,
                                  segments=[_Segments(self, S, T, kv_len)],
                                  ple_rows=None if self.ple is None else self.ple[:R],
                                  embed_rows=None if self.embed_rows is None else self.embed_rows[:R])

    def _graph(self, S: int, T: int):
        key = (S, T)
        if key not in self.graphs:
            from server.fast_path import capture_graph

            t0 = time.perf_counter()
            # one logits buffer of 64 rows shared by the stacked graphs (run() copies the rows out at once)
            self.graphs[key] = capture_graph(lambda: self._forward(S, T), self.lead, "stacked", MAX_ROWS)
            seconds = time.perf_counter() - t0
            self.capture_s += seconds
            self.capture_by_key[f"{S}x{T}"] = round(seconds, 3)
        return self.graphs[key]

    def summary(self) -> dict:
        return {"stacked_forwards": self.runs, "graphs": len(self.graphs), "capture_s": round(self.capture_s, 3),
                "replays": self.replays, "staging_s": round(self.staging_s, 4),
                "capture_s_by_steps_x_rows": dict(self.capture_by_key)}


def padded_rows(rows: int) -> int:
    """The forward's row count: the power of two at or above `rows` (at most MAX_ROWS, itself one).
    The compiled norms and elementwise ops then see the row counts of the lone steps' buckets,
    whose compiled kernels they already are, rather than one per S x T (a recompile per new row
    count, and torch.compile falls back to eager ops, other bits, past its cache limit)."""
    return 1 << max(1, rows - 1).bit_length()


class _Segments:
    """The per-sequence work of a stacked forward (the interface of server/fast_path.py's Segment,
    for all segments at once): S segments of T rows, positions and tables in the staging buffer."""

    def __init__(self, stacked: StackedStep, S: int, T: int, kv_len: int):
        self.stacked, self.S, self.T, self.kv_len = stacked, S, T, kv_len

    def prepare(self, pos: torch.Tensor, from_buffers: bool, step: bool, ops) -> None:
        from server.gpu_kernels import _write_slot_pos_segments

        st = self.stacked
        _write_slot_pos_segments[(self.S * self.T,)](st.table, st.wpos, st.ring_slot, self.T, st.width,
                                                       SLOT_POS_FIELD=st.slot_pos_field, **st.launch)

    def attend(self, layer, q: torch.Tensor, pos: torch.Tensor, step: bool, ops,
               new_kv: tuple | None = None) -> torch.Tensor:
        st = self.stacked
        lead = st.lead
        cache = lead.k_cache[layer.source]
        field = st.k_field[layer.source]
        return st.attention[layer.head_dim].segments(
            q, st.table, field, field + 1, self.S, self.T, self.kv_len, pos,
            layer.sliding, cache.shape[1], cache.stride(0), cache.stride(1), lead.path_buf.stride(0), st.width,
            st.slot_pos_field, st.path_field, lead.window, layer.hf.self_attn.scaling, new_kv=new_kv)
