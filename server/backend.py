"""The one interface between the engine and a model: a KV cache that starts, steps and rolls back.

Contract. A `Backend` owns one live sequence at a time (positions 0..position-1 in its KV cache):

- `start(prompt_ids) -> Prefill`: begin a sequence. With the prefix cache on, the longest common
  prefix with a kept sequence is reused and only the rest is computed; `Prefill.reused` says how
  many tokens came from the cache. `logits` are the last prompt token's ([vocab]). `reuse=False`
  computes everything and keeps nothing afterwards (measurements).
- `step(ids) -> logits [len(ids), vocab]`: append 1..max_step tokens at the current position.
- `rollback(n)`: forget the last n positions.
- `finish(tokens, generated)`: the request is over; `tokens` are the ids of positions
  0..position-1 (the last `generated` of them were generated) and may be kept for reuse.
  `discard()` forgets the live sequence without keeping it (after an error mid-forward).
- `max_context`: the positions it can serve; `max_step`: the most tokens one `step` takes.
- `prefix_summary()`: the prefix cache's budget, use, peak and counters, or None when it is off.

Invariant: whatever was reused, `start` returns the logits a fresh prefill of the whole prompt
would, to the backend's arithmetic (bit for bit on the eager fp32 path up to GEMM blocking; the
GPU path states its own). The engine (server/engine.py) is written against this protocol only, so
the verify rule, the cost-curve measurement and the request loop exist once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass
class Prefill:
    logits: torch.Tensor      # [vocab], the last prompt token's
    reused: int = 0           # prompt tokens whose KV came from the prefix cache
    notes: list[str] = field(default_factory=list)


class Backend(Protocol):
    max_context: int
    max_step: int
    position: int
    notes: list[str]

    def start(self, prompt_ids: list[int], reuse: bool = True) -> Prefill: ...
    def step(self, ids: list[int]) -> torch.Tensor: ...
    def rollback(self, n: int) -> None: ...
    def finish(self, tokens: np.ndarray, generated: int) -> None: ...
    def discard(self) -> None: ...
    def prefix_summary(self) -> dict | None: ...


def accept(draft: list[int], target: list[int]) -> int:
    """Greedy acceptance: feed [pending, d1..dn]; target[i] is the argmax after d_i (target[0]
    after pending). d_i is accepted iff d_1..d_i equal target[0..i-1]; returns the count k. The
    step then yields d_1..d_k plus target[k], exactly the k+1 tokens plain decoding would give."""
    k = 0
    while k < len(draft) and draft[k] == target[k]:
        k += 1
    return k


@torch.no_grad()
def measure_cost_curve(backend: Backend, vocab: int, max_tokens: int = 16, context_len: int = 256,
                       repeats: int = 3, points: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)) -> np.ndarray:
    """Forward time for n new tokens on a `context_len` cache, relative to n = 1, through `backend`.

    Each length is timed `repeats` times after a warm-up and the fastest run kept: on a shared
    machine interference only ever adds time. The lengths in `points` (plus max_tokens) are measured
    and the rest interpolated linearly; the curve is kept as measured (on CPU fp32 a 2-token forward
    can cost more than a 4-token one, and the rule should see that). Returns cost[0..max_tokens].
    Nothing measured here is kept in the prefix cache.
    """
    gen = torch.Generator().manual_seed(0)
    backend.start(torch.randint(3, vocab, (context_len,), generator=gen).tolist(), reuse=False)
    pts = sorted({p for p in points if p <= max_tokens} | {1, max_tokens})
    timings = {}
    try:
        for n in pts:
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            samples = []
            for r in range(repeats + 1):  # the first run of each shape is a warm-up
                t0 = time.perf_counter()
                backend.step(ids).argmax(-1).cpu()
                if r:
                    samples.append(time.perf_counter() - t0)
                backend.rollback(n)
            timings[n] = min(samples)
    finally:
        backend.discard()
    rel = np.interp(np.arange(max_tokens + 1), pts, [timings[p] / timings[1] for p in pts])
    rel[0] = 0.0
    rel[1] = 1.0
    return rel
