"""The one interface between the engine and a model: a KV cache that starts, steps and rolls back.

Contract. A `Backend` owns one live sequence at a time (positions 0..position-1 in its KV cache):

- `start(prompt_ids) -> Prefill`: begin a sequence. With the prefix cache on, the longest common
  prefix with a kept sequence is reused and only the rest is computed; `Prefill.reused` says how
  many tokens came from the cache. `logits` are the last prompt token's ([vocab]). `reuse=False`
  computes everything and keeps nothing afterwards (measurements).
- `step(ids) -> logits [len(ids), vocab]`: append 1..max_step tokens at the current position.
- `rollback(n)`: forget the last n positions.
- Token trees, where `supports_tree` is True: `step(ids, parents=parents)` feeds a tree, parents[0]
  == -1 (the pending token, after the cached positions) and 0 <= parents[j] < j. Row j sits at
  position `position + depth(j)` and sees the cached positions and its ancestors (itself included),
  nothing else, so its logits are the ones a chain of its path gives there (bit for bit where the
  backend's chain verify is). Its K/V take step slot j for now; `position` advances by len(ids).
  `keep_path(path)` then keeps the rows of one root path ([0, r1, .., rk], increasing, each the
  parent of the next) at consecutive positions and forgets the rest: the cache is what a chain
  step of those tokens would leave.
- `finish(tokens, generated)`: the request is over; `tokens` are the ids of positions
  0..position-1 (the last `generated` of them were generated) and may be kept for reuse.
  `discard()` forgets the live sequence without keeping it (after an error mid-forward).
- `max_context`: the positions it can serve; `max_step`: the most tokens one `step` takes.
- `prefix_summary()`: the prefix cache's budget, use, peak and counters, or None when it is off.
- Optional, where steps run asynchronously (the GPU fast path): `async_steps` (a step returns before
  its forward has run), and `chains_steps` with `step_after_argmax(logits) -> (token, logits)`: the
  argmax of `logits` and a one-token step of it, launched from the argmax on the device before the
  token is read back (what `token = row_argmax(logits)[0]; step([token])` gives).

Invariant: whatever was reused, `start` returns the logits a fresh prefill of the whole prompt
would, to the backend's arithmetic (bit for bit on the eager fp32 path up to GEMM blocking; the
GPU path states its own). The engine (server/engine.py) is written against this protocol only, so
the verify rule, the cost-curve measurement and the request loop exist once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from server.sampling import row_argmax


@dataclass
class Prefill:
    logits: torch.Tensor      # [vocab], the last prompt token's
    reused: int = 0           # prompt tokens whose KV came from the prefix cache


class Backend(Protocol):
    max_context: int
    max_step: int
    position: int

    def start(self, prompt_ids: list[int], reuse: bool = True) -> Prefill: ...
    def step(self, ids: list[int]) -> torch.Tensor: ...
    def rollback(self, n: int) -> None: ...
    def finish(self, tokens: np.ndarray, generated: int) -> None: ...
    def discard(self) -> None: ...
    def prefix_summary(self) -> dict | None: ...


def checked_prompt(prompt_ids: list[int], max_context: int) -> np.ndarray:
    """The prompt as int32 ids, or a ValueError for one that is empty or longer than the context."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    if len(prompt_ids) > max_context:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the context of {max_context}")
    return np.asarray(prompt_ids, dtype=np.int32)


def accept(draft: list[int], target: list[int]) -> int:
    """Greedy acceptance: feed [pending, d1..dn]; target[i] is the argmax after d_i (target[0]
    after pending). d_i is accepted iff d_1..d_i equal target[0..i-1]; returns the count k. The
    step then yields d_1..d_k plus target[k], exactly the k+1 tokens plain decoding would give."""
    k = 0
    while k < len(draft) and draft[k] == target[k]:
        k += 1
    return k


@torch.no_grad()
def time_forwards(backend: Backend, context: list[int], lengths: list[int], rounds: int = 5,
                  progress=None) -> dict[int, float]:
    """Median seconds of an n-token forward on the cache of `context`, for each n in `lengths`.

    Robust on a busy machine: the lengths are timed in interleaved rounds (every length once per
    round, after one warm-up round that is not kept), so a burst of load hits all of them alike;
    each statistic is the median over the rounds. Every forward ends in a device-to-host copy, so
    GPU time is included. `progress(message)` hears, after the warm-up, about how long it will
    take. Nothing measured here is kept in the prefix cache."""
    backend.start(list(context), reuse=False)
    samples: dict[int, list[float]] = {n: [] for n in lengths}
    try:
        for r in range(rounds + 1):
            t_round = time.perf_counter()
            for n in lengths:
                t0 = time.perf_counter()
                row_argmax(backend.step(list(context[-n:])))  # what a verify does with the logits
                if r:
                    samples[n].append(time.perf_counter() - t0)
                backend.rollback(n)
            if r == 0 and progress is not None:
                est = (time.perf_counter() - t_round) * rounds
                progress(f"measuring the verify cost curve: {rounds} rounds of {len(lengths)} forward sizes, "
                         f"about {est:.0f} s")
    finally:
        backend.discard()
    return {n: float(np.median(samples[n])) for n in lengths}


def measure_cost_curve(backend: Backend, vocab: int, max_tokens: int, context_len: int = 256,
                       rounds: int = 5, points: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16),
                       progress=None) -> np.ndarray:
    """Forward time for n new tokens on a `context_len` cache of random ids, relative to n = 1.

    The lengths in `points` (plus max_tokens) are timed by `time_forwards`; the relative costs are
    then fitted non-decreasing in n (pool-adjacent-violators: a longer forward never costs less)
    and at least 1, and interpolated between the points. Returns cost[0..max_tokens], cost[1] == 1.
    """
    context = _curve_context(vocab, context_len)
    pts = sorted({p for p in points if p <= max_tokens} | {1, max_tokens})
    seconds = time_forwards(backend, context, pts, rounds, progress)
    rel = monotone_fit([max(1.0, seconds[n] / seconds[1]) for n in pts])
    curve = np.interp(np.arange(max_tokens + 1), pts, rel)
    curve[0] = 0.0
    curve[1] = 1.0
    return curve


# A kept curve still holds when the ratio of its largest forward to a 1-token one, measured again at
# start-up, is within this factor of the kept one (either way). Measured on the bundled model's CPU
# path (2 cores): the ratio at 17 tokens is 2.95-2.98 on a quiet machine, and a curve kept from a
# start whose measurement ran beside other work said 1.28; drafting sized by it verified drafts
# that did not pay (python -m bench.concurrency, one run each: drafted tokens/s 166 -> 202 at one
# stream and 238 -> 283 at four once the curve was measured again). A tiny model's
# sub-millisecond forwards measure within 1.17x of their kept ratio (30 checks).
KEPT_CURVE_TOLERANCE = 1.35


def kept_curve_check(backend: Backend, vocab: int, curve: np.ndarray, context_len: int = 256,
                     rounds: int = 5) -> tuple[bool, float]:
    """(whether `curve`, kept from an earlier start, still holds; the cost of its largest forward
    measured now): that forward and a 1-token one timed as `measure_cost_curve` times them (2 of
    its 9 forward sizes), compared with the curve's last point within
    KEPT_CURVE_TOLERANCE. A curve measured while other work shared the machine, or on a machine
    that has changed since, does not hold; the engine then measures the whole curve again and
    replaces the kept one where that measurement disagrees with it too (`curves_agree`)."""
    n = len(curve) - 1
    seconds = time_forwards(backend, _curve_context(vocab, context_len), [1, n], rounds)
    now = max(1.0, seconds[n] / seconds[1])
    return _within(now, float(curve[n])), now


def curves_agree(measured: np.ndarray, kept: np.ndarray) -> bool:
    """Whether a curve measured now agrees with a kept one at its largest forward (within
    KEPT_CURVE_TOLERANCE). A kept curve that failed its check is still kept when the whole curve,
    measured again, agrees with it: a check that timed a moment's load costs one measurement, not
    a good curve."""
    return len(measured) == len(kept) and _within(float(measured[-1]), float(kept[-1]))


def _within(a: float, b: float) -> bool:
    a, b = max(1.0, a), max(1.0, b)
    return max(a / b, b / a) <= KEPT_CURVE_TOLERANCE


def _curve_context(vocab: int, context_len: int) -> list[int]:
    """The cache a cost curve's forwards run on: random ids, the same for a measurement and for
    the check of a kept curve (their ratios are comparable)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (context_len,), generator=gen).tolist()


def monotone_fit(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out += [s / c] * c
    return out
