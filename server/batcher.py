"""Steps of several requests in one forward, on the CPU int8 path: continuous batching by rendezvous.

Contract: `StepBatcher(model)` is shared by the lanes (server/cpu_backend.py `CpuBackend`s, one per
running request) of one CpuGemma. A lane `join()`s when its request starts and `leave()`s when it
ends; `run(rows)` (a server.cpu_model.Rows: a prefill chunk, a step or a token tree) blocks until
a forward carrying it has run, and returns its logits and the load the other lanes put on that
forward (the cost model weighs a draft against it: server/cost_model.py). The forward carries
every lane's pending rows: it runs as soon as every joined lane is waiting in `run`, or when the
oldest waiting rows have waited `linger_s` (counted from the end of any forward that ran meanwhile),
about one forward's time (a lane busy elsewhere,
drafting or detokenizing, does not hold the others up for longer). The thread whose arrival completes the batch, or whose wait ran out, runs it; the
others sleep until their rows are done. Requests join and leave between forwards, and a long
prompt's prefill goes chunk by chunk, each chunk batched with the other lanes' steps (short chunks
while others run: server/cpu_backend.py).

Why outputs do not change: CpuGemma.forward_batch computes each row with the arithmetic it gets
alone (batch-invariant kernels; each sequence attends to its own cache), so which lanes share a
forward changes no bit of any lane's logits. tests/test_batching.py checks 1, 2, 4 and 8
concurrent streams against solo runs, greedy and seeded sampling, drafted and plain.

Counters (for /metrics and /health): `forwards`, `rows` and `sequences` summed over forwards, and
`last_sequences`, `peak_sequences` (sequences in one forward).
"""
from __future__ import annotations

import threading
import time

import numpy as np

# How long the oldest rows wait for lanes still busy elsewhere before their forward runs: about one
# forward's time (a running average, within these bounds). Measured on the bundled model, 4 plain
# streams, 2 cores: a 2 ms wait gathered 2.0 sequences a forward (1.05x one stream's tokens/s), 5 ms
# 2.4 (1.24x), 10 ms, about one forward, 3.5 (1.50x): a lane comes back from its Python work (commit,
# detokenize, draft: serialized by the GIL across lanes) later than a short wait allows.
LINGER_MIN_S, LINGER_MAX_S = 0.002, 0.05


class _Pending:
    __slots__ = ("rows", "arrived", "logits", "error", "done", "others")

    def __init__(self, rows):
        self.rows, self.arrived = rows, time.perf_counter()
        self.logits, self.error, self.done = None, None, False
        self.others = (0, 0)  # (sequences, rows) that shared its forward besides it


class StepBatcher:
    def __init__(self, model, linger_s: float | None = None):
        self.model = model
        self.fixed_linger = linger_s  # None: about one forward's time (see LINGER_MIN_S)
        self.linger_s = linger_s if linger_s is not None else LINGER_MIN_S
        self._forward_s = 0.0  # running average of a forward's wall time
        self._cv = threading.Condition()
        self._pending: list[_Pending] = []
        self._members = 0
        self._running = False  # a forward is in flight (its lanes are not pending)
        self._free_since = 0.0  # when the last forward ended (perf_counter)
        self.forwards = self.rows = self.sequences = 0
        self.last_sequences = self.peak_sequences = 0

    @property
    def members(self) -> int:
        """Lanes in a request now."""
        return self._members

    def join(self) -> None:
        with self._cv:
            self._members += 1

    def leave(self) -> None:
        with self._cv:
            self._members -= 1
            self._cv.notify_all()  # a lane that left may have been the one the others waited for

    def run(self, rows) -> tuple[np.ndarray, tuple[int, int]]:
        """(the rows' logits, (sequences, rows) of the others that shared their forward)."""
        me = _Pending(rows)
        with self._cv:
            # No one is woken here: an arrival that completes the batch runs it itself (below), and
            # it changes no waiter's deadline (the oldest rows' wait). Waking every waiting lane on
            # each arrival made S lanes' rendezvous cost S * S thread wake-ups a forward.
            self._pending.append(me)
            while not me.done:
                batch = self._take_batch()
                if batch is None:
                    self._cv.wait(timeout=self._wait_s(me))
                    continue
                self._running = True
                self._cv.release()
                try:
                    self._forward(batch)
                finally:
                    self._cv.acquire()
                    self._running = False
                    self._free_since = time.perf_counter()
                    self._cv.notify_all()
        if me.error is not None:
            raise me.error
        return me.logits, me.others

    def _take_batch(self) -> list[_Pending] | None:
        """The pending rows, when their forward should run now (see the module docstring)."""
        if self._running or not self._pending:
            return None
        waited = time.perf_counter() - self._waiting_since(self._pending[0])
        if len(self._pending) < self._members and waited < self.linger_s:
            return None
        batch, self._pending = self._pending, []
        return batch

    def _wait_s(self, me: _Pending) -> float:
        """How long a lane whose rows are not done sleeps before it looks again. While a forward
        runs, nothing can start before its end, which wakes every lane (notify_all): the lane sleeps
        until then (LINGER_MAX_S at most, a bound, not a poll). Otherwise until the oldest rows'
        linger runs out, when their forward must start. Before, a lane that had waited its linger
        while a forward still ran looked again every 0.1 ms until it ended: on 16 lanes of a tiny
        model (CPU) 33,070 of 35,674 waits were such looks, each taking the GIL from the lane
        that ran the forward."""
        if self._running:
            return LINGER_MAX_S
        oldest = self._waiting_since(self._pending[0] if self._pending else me)
        return max(1e-4, oldest + self.linger_s - time.perf_counter())

    def _waiting_since(self, pending: _Pending) -> float:
        """When rows began to wait for lanes rather than for a forward: their arrival, or the end
        of the forward that ran while they arrived. Counted from arrival, two lanes fall into
        turns: each arrives while the other's forward runs, has waited its linger when it ends,
        and runs alone (measured on the GPU fast path: 2 streams never shared a forward)."""
        return max(pending.arrived, self._free_since)

    def _forward(self, batch: list[_Pending]) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.model.forward_batch([p.rows for p in batch])
        except BaseException as e:  # every lane of the forward hears of it; the batcher keeps serving
            for p in batch:
                p.error, p.done = e, True
            return
        total = sum(p.rows.ids.shape[0] for p in batch)
        for p, logits in zip(batch, outs):
            p.logits, p.others, p.done = logits, (len(batch) - 1, total - p.rows.ids.shape[0]), True
        # A model may say how long its forwards took, less any wait for a lock (server/fast_batch.py).
        seconds = getattr(self.model, "last_forward_s", None) or (time.perf_counter() - t0)
        self._forward_s = seconds if self.forwards == 0 else 0.8 * self._forward_s + 0.2 * seconds
        if self.fixed_linger is None:
            self.linger_s = min(LINGER_MAX_S, max(LINGER_MIN_S, self._forward_s))
        self.forwards += 1
        self.sequences += len(batch)
        self.rows += total
        self.last_sequences = len(batch)
        self.peak_sequences = max(self.peak_sequences, len(batch))

    def summary(self) -> dict:
        return {"forwards": self.forwards, "rows": self.rows, "sequences": self.sequences,
                "last_sequences": self.last_sequences, "peak_sequences": self.peak_sequences,
                "members": self._members}
