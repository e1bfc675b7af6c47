"""Token choice for one request: greedy or sampled, with every OpenAI/vLLM sampling field, and
random draws keyed by output position so that drafting never changes a sampled token.

Contract: `Sampler(params, prompt_ids)` picks the token of output position i (0 = the first token
after the prompt) from the target's logits at that position with `pick(logits, i, pending)`, where
`pending` are tokens generated before position i that are not committed yet (the drafted tokens
ahead of this row in a verify step); `commit(token)` records a committed token. The choice depends
only on the logits, the tokens before position i and (seed, i), never on how positions were grouped
into forwards, so for the same seed plain decoding and drafted decoding give the same tokens.

Order of processing (vLLM's): on the raw logits,
  1. repetition_penalty r (tokens in the prompt or the output): a positive logit is divided by r, a
     negative one multiplied by r;
  2. frequency_penalty f and presence_penalty p (tokens in the output): logit -= f * count + p * [count > 0];
  3. temperature 0 (or top_k 1): the argmax, done;
  4. logits / temperature, then top_k, then top_p (the smallest most-likely set whose probability
     reaches top_p), then min_p (tokens at least min_p times the most likely one's probability);
  5. the draw among the tokens left: inverse-CDF sampling of their renormalized probabilities with
     one uniform u, a counter-based hash of (seed, i). This is an exact sample of the processed
     distribution, and one u per position keeps a 262k vocabulary cheap (no per-token noise).
Verification under sampling (server.engine): the target is sampled at every drafted position with
these rules; a drafted token is accepted while it equals the sampled one, and the first sampled token
that differs is the step's new token. With a deterministic drafter the output is distributed as plain
sampling, and with keyed draws it is the very same sequence.

Greedy rows: `row_argmax(logits)`, or the values `with_argmax` attached to the logits (a shared GPU
forward reads all its rows' argmax back at once: server/batch_step.py); `row_of` keeps them for one row.
"""
from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

_MASK = (1 << 64) - 1
_TOP_P_FIRST = 1024  # top_p without top_k looks at this many most likely tokens before sorting all


_ARGMAX = "_rows_argmax"  # the attribute `with_argmax` sets on logits: their rows' argmax, a tuple


def row_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first maximal index, NaN counting as maximal) as Python ints; one
    entry for a single row [vocab]. The values `with_argmax` attached to these very logits when
    there are any (a shared forward's, read back once for all its lanes). On the CPU numpy's:
    torch's CPU argmax along rows of a 262k vocabulary takes about 8 ms for 16 rows where numpy
    takes 0.3 (it was a third of a 16-token verify on the int8 path, and inflated the measured
    verify cost curve). Elsewhere torch's."""
    known = getattr(logits, _ARGMAX, None)
    if known is not None:
        return list(known)
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return np.atleast_1d(logits.detach().numpy().argmax(-1)).tolist()
    return logits.argmax(-1).reshape(-1).tolist()


def with_argmax(logits: torch.Tensor, argmax: list[int]) -> torch.Tensor:
    """`logits` [rows, vocab] carrying each row's argmax, computed by whoever made them (`argmax`:
    torch's argmax of these rows, so `row_argmax` returns what it would compute). A forward shared
    by several lanes reads all its rows' argmax back in one copy where each lane would wait for
    its own (server/batch_step.py). Slices and copies of the logits do not carry it (`row_of`
    keeps it for one row). Invariant: nothing changes attached logits in place (a grammar's mask
    and the penalties make new tensors), or the attached values would be stale."""
    rows = 1 if logits.dim() == 1 else logits.shape[0]
    if len(argmax) != rows:
        raise ValueError(f"{len(argmax)} argmax values for {rows} rows")
    setattr(logits, _ARGMAX, tuple(argmax))
    return logits


def row_of(logits: torch.Tensor, i: int) -> torch.Tensor:
    """Row i of logits [rows, vocab], carrying its argmax when the logits carry theirs
    (`with_argmax`): a plain step's one row keeps what its shared forward read back."""
    row = logits[i]
    known = getattr(logits, _ARGMAX, None)
    return row if known is None else with_argmax(row, [known[i]])


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None        # None: a random one per request

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def plain_argmax(self) -> bool:
        """True when the token is the argmax of the raw logits (the engine's vectorized greedy path)."""
        return self.greedy and not self.penalized


def _mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (a 64-bit key from a seed and a position)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


def position_uniform(seed: int, position: int) -> float:
    """u in (0, 1), a pure function of (seed, output position): splitmix64's finalizer, applied twice,
    over a key mixed from both (53 random bits)."""
    z = _mix64(_mix64((seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK))
    return ((z >> 11) + 0.5) * (1.0 / (1 << 53))


class Sampler:
    def __init__(self, params: SamplingParams, prompt_ids: list[int] | np.ndarray):
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.output_counts: Counter[int] = Counter()
        self._prompt_ids = (np.unique(np.asarray(prompt_ids, dtype=np.int64))
                            if params.repetition_penalty != 1.0 else np.zeros(0, dtype=np.int64))

    def commit(self, token: int) -> None:
        if self.params.penalized:
            self.output_counts[token] += 1

    def pick(self, logits: torch.Tensor, position: int, pending: list[int] | tuple = ()) -> int:
        p = self.params
        if p.plain_argmax:
            return row_argmax(logits)[0]
        # numpy from here: single-threaded, and fast on one row (torch's threaded elementwise ops over
        # a 262k vocabulary cost more in hand-off than in work)
        scores = logits.detach().float().cpu().numpy()
        if p.penalized:
            scores = self._penalize(scores.copy(), pending)
        if p.greedy:
            return int(scores.argmax())
        ids, vals = self._candidates(scores)
        return int(ids[_inverse_cdf(np.exp(vals - vals.max()), position_uniform(self.seed, position))])

    def _penalize(self, scores: np.ndarray, pending) -> np.ndarray:
        p = self.params
        counts = self.output_counts + Counter(int(t) for t in pending) if pending else self.output_counts
        out_ids = np.fromiter(counts, dtype=np.int64, count=len(counts))
        if p.repetition_penalty != 1.0:
            seen = np.union1d(self._prompt_ids, out_ids)
            vals = scores[seen]
            scores[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if len(out_ids) and (p.frequency_penalty or p.presence_penalty):
            n = np.fromiter((counts[int(t)] for t in out_ids), dtype=np.float32, count=len(out_ids))
            scores[out_ids] -= p.frequency_penalty * n + p.presence_penalty
        return scores

    def _candidates(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, their logits / temperature) that survive top_k, top_p and min_p, most likely
        first when top_k or top_p cut (temperature keeps the order, so the cut comes first)."""
        p = self.params
        vocab = scores.shape[0]
        if p.top_k > 0 or p.top_p < 1.0:
            k = min(p.top_k if p.top_k > 0 else _TOP_P_FIRST, vocab)
            vals, ids = torch.topk(torch.from_numpy(scores), k)
            vals, ids = vals.numpy().astype(np.float64) / p.temperature, ids.numpy()
            if p.top_p < 1.0:
                # probabilities over what top_k left (the whole vocabulary when top_k is off)
                log_z = _logsumexp(vals) if p.top_k > 0 else _logsumexp(scores.astype(np.float64) / p.temperature)
                cum = np.cumsum(np.exp(vals - log_z))
                if p.top_k <= 0 and cum[-1] < p.top_p and k < vocab:  # the first tokens were not enough
                    ids = np.argsort(-scores, kind="stable")
                    vals = scores[ids].astype(np.float64) / p.temperature
                    cum = np.cumsum(np.exp(vals - log_z))
                # up to and including the first token where the cumulative mass reaches top_p
                keep = int(np.searchsorted(cum, p.top_p)) + 1
                vals, ids = vals[:keep], ids[:keep]
        else:
            vals, ids = scores / np.float32(p.temperature), np.arange(vocab)  # float32: exp at SIMD speed
        if p.min_p > 0.0:
            keep = vals >= vals.max() + np.log(p.min_p)
            vals, ids = vals[keep], ids[keep]
        return ids, vals


def _inverse_cdf(weights: np.ndarray, u: float, block: int = 512) -> int:
    """The index i with cumsum(weights)[i-1] <= u * sum(weights) < cumsum(weights)[i]. Two levels
    (block sums, then one block's cumsum) so that a whole vocabulary costs two passes, not a serial
    cumsum; a pure function of (weights, u), like everything that chooses a token."""
    n = weights.shape[0]
    if n <= 4 * block:
        cdf = np.cumsum(weights, dtype=np.float64)
        return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), n - 1)
    padded = np.zeros(-(-n // block) * block, dtype=np.float64)
    padded[:n] = weights
    sums = np.cumsum(padded.reshape(-1, block).sum(1))
    b = min(int(np.searchsorted(sums, u * sums[-1], side="right")), len(sums) - 1)
    rest = u * sums[-1] - (sums[b - 1] if b else 0.0)
    inner = np.cumsum(padded[b * block:(b + 1) * block])
    return min(b * block + int(np.searchsorted(inner, rest, side="right")), n - 1)


def _logsumexp(x: np.ndarray) -> float:
    m = float(x.max())
    return m + float(np.log(np.exp(x - m).sum()))


def sampling_defaults(generation_config) -> dict:
    """Defaults for the sampling fields a request omits, from a checkpoint's generation_config (as vLLM
    takes them): its explicitly set temperature, top_p, top_k, min_p and repetition_penalty when it
    samples (`do_sample`, temperature 1.0 unless it says otherwise); {} (greedy) when it sets none or
    does not sample, as for the bundled base model."""
    explicit = generation_config.to_diff_dict() if generation_config is not None else {}
    if not explicit.get("do_sample"):
        return {}
    out = {"temperature": float(explicit.get("temperature", 1.0))}
    for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
        if explicit.get(name) is not None:
            out[name] = explicit[name]
    return out


def describe_defaults(defaults: dict) -> str:
    if not defaults:
        return "greedy (temperature 0) unless a request asks to sample"
    return "from the checkpoint's generation_config: " + ", ".join(f"{k} {v}" for k, v in defaults.items())
