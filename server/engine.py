"""The target engine: greedy decoding of one request at a time, with drafts verified losslessly.

Contract: `Engine.generate(prompt_ids, params)` yields `GenerationChunk`s whose tokens are exactly
what plain greedy decoding of the target yields (same stop tokens, stop strings and max_tokens),
whether or not drafts are used; drafting only changes how many forward passes it takes. The engine
works on token ids; the tokenizer is used only to detokenize for stop strings and text deltas.
It is synchronous and not thread-safe: the server serializes calls.

One step of the loop: the last committed token is "pending" (not yet in the KV cache). A plain step
feeds it alone (`decode_one`); a verify step feeds it followed by n drafted tokens (`verify`) and
rolls the cache back past the first rejected token (`rollback`). Sliding-window cache layers keep
their past entries until the rollback that follows every forward
(`DynamicSlidingWindowLayer.activate_past_recording`), so rollback stays exact for contexts
longer than the window; KV-shared layers (Gemma 4) own no keys and are skipped.

Counters: `drafts` = non-empty drafts proposed, `verify_steps` = forwards that verified a draft,
`plain_steps` = one-token forwards, `drafted_tokens` / `accepted_tokens` = drafted tokens verified /
accepted, `completion_tokens` = generated tokens including a final stop token (which is never emitted).

GPU fast path: on CUDA, for a model `server.fast_path` supports (Gemma 4 text), with
`EngineConfig.fast_path` on (the server's `--no-fast-path` turns it off), the engine builds a
`FastTarget` at start-up (static KV cache, CUDA graphs per draft bucket), captures its graphs, caps
`max_context` at what its cache holds, measures the cost curve through it, and runs prefill, plain
steps and verifies through it instead of the DynamicCache functions below. `engine.notes` says which
path runs and why.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

from ngram.draft import Draft
from server.cost_model import (AcceptanceTracker, DraftPolicy, flat_policy, measure_cost_curve,
                               measure_fast_cost_curve)

DEFAULT_FAST_BUCKETS = (1, 2, 4, 8, 16)  # fast-path step sizes, each one CUDA graph


class DrafterSession(Protocol):
    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft: ...
    def feedback(self, drafted: int, accepted: int) -> None: ...


class Drafter(Protocol):
    def session(self) -> DrafterSession: ...


@dataclass
class GenerationParams:
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    draft: bool = True          # False = plain decoding, the baseline
    temperature: float = 0.0    # >0: sampled decoding without drafting
    seed: int | None = None


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    probes: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0       # wall time after the prefill, everything included
    draft_s: float = 0.0        # drafter.propose + the draft/no-draft decision
    forward_s: float = 0.0      # model forwards (decode and verify) and their argmax

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first (which the prefill yields) per decode second."""
        return max(self.completion_tokens - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class GenerationChunk:
    token_ids: list[int]      # tokens committed in this step (after stop trimming)
    text: str                 # their decoded text delta (stop strings removed)
    finish_reason: str | None # None while generating, then "stop" or "length"
    stats: RequestStats       # running per-request counters


@dataclass
class EngineConfig:
    max_draft: int = 15                   # drafted tokens per verify: forwards of up to 16 tokens
    adaptive: bool = True                 # False: verify every draft in full (tests, ablations)
    cost_curve: np.ndarray | None = None  # cost[n] of an n-token forward; None: measured at start-up
    cost_context: int = 256               # cache length the cost curve is measured at
    max_context: int | None = None        # None: the model's max_position_embeddings
    fast_path: bool = True                # CUDA + supported model: static cache and CUDA graphs
    fast_max_context: int = 8192          # fast path: context its static cache holds (full-attention
                                          # layers read every slot each step, so bigger costs time)


# ---------------------------------------------------------------- model primitives (torch only)

def new_cache(model):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    return cache


def forward(model, ids: torch.Tensor, cache, logits_to_keep: int) -> torch.Tensor:
    """Logits [logits_to_keep, vocab] for the last positions of `ids` [1, n]; appends n to the cache."""
    kwarg = _cache_kwarg(model)
    return model(input_ids=ids, use_cache=True, logits_to_keep=logits_to_keep, **{kwarg: cache}).logits[0]


def rollback(cache, n: int) -> None:
    """Drop the last n positions from every layer that owns keys (also trims sliding layers to their window)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            layer.crop(-n)


def prefill(model, cache, prompt_ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    logits = forward(model, torch.tensor([prompt_ids], device=device), cache, logits_to_keep=1)
    rollback(cache, 0)
    return logits[-1]


def decode_one(model, cache, token: int) -> torch.Tensor:
    device = next(model.parameters()).device
    logits = forward(model, torch.tensor([[token]], device=device), cache, logits_to_keep=1)
    rollback(cache, 0)
    return logits[-1]


# Acceptance rule (greedy): feed [pending, d1..dn]; g_i is the target's argmax after d_i (g_0 after
# pending). d_i is accepted iff d_1..d_i equal g_0..g_{i-1}. With k accepted, the step yields
# d_1..d_k plus g_k, exactly the k+1 tokens plain decoding would give; d_{k+1}..d_n leave the cache.
def verify(model, cache, pending: int, draft: list[int]) -> list[int]:
    device = next(model.parameters()).device
    ids = torch.tensor([[pending, *draft]], device=device)
    target = forward(model, ids, cache, logits_to_keep=len(draft) + 1).argmax(-1).tolist()
    k = 0
    while k < len(draft) and draft[k] == target[k]:
        k += 1
    rollback(cache, len(draft) - k)
    return draft[:k] + [target[k]]


_CACHE_KWARGS: dict[type, str] = {}


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x takes `cache=`; older releases `past_key_values=`."""
    cls = type(model)
    if cls not in _CACHE_KWARGS:
        params = inspect.signature(model.forward).parameters
        _CACHE_KWARGS[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARGS[cls]


# ---------------------------------------------------------------- text: deltas and stop strings

class TextStream:
    """Incremental detokenization with stop strings. Deltas are decoded against a few tokens of
    left context so that leading spaces and multi-byte characters come out exactly once."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...], prompt_tail: list[int]):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.ids = list(prompt_tail)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0

    def add(self, token: int) -> bool:
        """Append a token; True when a stop string is complete (the text is cut before it)."""
        self.ids.append(token)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=False)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=False)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete multi-byte character: wait for the next token
        before = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hits = []
        for stop in self.stop_strings:
            i = self.text.find(stop, max(0, before - len(stop) + 1))
            if i >= 0:
                hits.append(i)
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def take(self, final: bool) -> str:
        """The text not handed out yet, holding back a tail that may still become a stop string."""
        end = len(self.text)
        if not final:
            for stop in self.stop_strings:
                for j in range(min(len(stop) - 1, end - self.emitted), 0, -1):
                    if self.text.endswith(stop[:j]):
                        end = min(end, len(self.text) - j)
                        break
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta


# ---------------------------------------------------------------- the engine

class Engine:
    def __init__(self, target, drafter: Drafter | None = None, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.target = target
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.model_id = target.model_id
        text_config = self.model.config.get_text_config()
        self.max_context = self.config.max_context or text_config.max_position_embeddings
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self._drafter = drafter
        self.notes: list[str] = []
        self.fast = self._build_fast_path()
        if not self.config.adaptive:
            self.policy = flat_policy(self.config.max_draft)
        else:
            curve = self.config.cost_curve
            if curve is None and self.fast is not None:
                curve = measure_fast_cost_curve(self.fast, self.config.max_draft + 1, self.config.cost_context)
            elif curve is None:
                curve = measure_cost_curve(self.model, self.config.max_draft + 1, self.config.cost_context)
            self.policy = DraftPolicy(np.asarray(curve, dtype=np.float64))
        self._totals = {name: 0 for name in ("requests", "completion_tokens", "drafts", "drafted_tokens",
                                             "accepted_tokens", "verify_steps", "plain_steps", "probes")}
        self._totals.update(prefill_s=0.0, decode_s=0.0, draft_s=0.0, forward_s=0.0)

    def _build_fast_path(self):
        """The FastTarget when the fast path applies (graphs captured here), else None; notes say why."""
        device = next(self.model.parameters()).device
        if not self.config.fast_path:
            self.notes.append("eager path: fast path off (--no-fast-path)")
            return None
        if device.type != "cuda":
            self.notes.append(f"eager path: no CUDA (device {device.type}); the fast path needs CUDA graphs")
            return None
        from server.fast_path import FastTarget, unsupported_reason

        reason = unsupported_reason(self.model)
        if reason is not None:
            self.notes.append(f"eager path: {reason}")
            return None
        if self.config.max_draft + 1 > DEFAULT_FAST_BUCKETS[-1]:
            self.notes.append(f"fast path: drafts capped at {DEFAULT_FAST_BUCKETS[-1] - 1} tokens "
                              f"(its largest step is {DEFAULT_FAST_BUCKETS[-1]}; max_draft was {self.config.max_draft})")
            self.config = replace(self.config, max_draft=DEFAULT_FAST_BUCKETS[-1] - 1)
        context = min(self.max_context, self.config.fast_max_context)
        # A padded step may write up to one bucket past the last committed position: room for it.
        fast = FastTarget(self.model, max_len=context + DEFAULT_FAST_BUCKETS[-1], buckets=DEFAULT_FAST_BUCKETS)
        seconds = fast.warmup()
        self.max_context = context
        self.notes.append(f"fast path: CUDA graphs, static cache ({fast.timings.graphs} graphs captured in "
                          f"{seconds:.1f} s; context capped at {context} tokens, KV cache "
                          f"{fast.cache_bytes() / 2**30:.2f} GiB); {fast.step_kernel_note}")
        return fast

    def set_drafter(self, drafter: Drafter | None) -> None:
        self._drafter = drafter

    def totals(self) -> dict:
        return dict(self._totals)

    def generate(self, prompt_ids: list[int], params: GenerationParams,
                 cancelled: Callable[[], bool] | None = None) -> Iterator[GenerationChunk]:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_context}")
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        self._totals["requests"] += 1
        try:
            yield from self._generate(prompt_ids, params, cancelled, stats)
        finally:
            for f in fields(RequestStats):
                if f.name in self._totals:
                    self._totals[f.name] += getattr(stats, f.name)

    def _generate(self, prompt_ids, params, cancelled, stats) -> Iterator[GenerationChunk]:
        max_tokens = min(params.max_tokens, self.max_context - len(prompt_ids))
        if max_tokens <= 0:
            yield GenerationChunk([], "", "length", stats)
            return
        stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids)
        text = TextStream(self.tokenizer, tuple(params.stop_strings), prompt_ids[-4:])
        context = np.zeros(len(prompt_ids) + max_tokens, dtype=np.int32)
        context[:len(prompt_ids)] = prompt_ids
        length = len(prompt_ids)
        sampling = params.temperature > 0
        generator = torch.Generator().manual_seed(params.seed) if sampling and params.seed is not None else None
        session = self._drafter.session() if (self._drafter is not None and params.draft and not sampling) else None
        tracker = AcceptanceTracker()
        model, fast = self.model, self.fast

        with torch.no_grad():
            t0 = time.perf_counter()
            if fast is not None:
                cache = None
                new = [self._pick(fast.prefill(prompt_ids), params, generator)]
            else:
                cache = new_cache(model)
                new = [self._pick(prefill(model, cache, prompt_ids), params, generator)]
            stats.prefill_s = time.perf_counter() - t0
            t_decode = time.perf_counter()
            while True:
                # Commit one step's tokens one by one, exactly as plain decoding would.
                emitted, finish = [], None
                for token in new:
                    stats.completion_tokens += 1
                    context[length] = token
                    length += 1
                    if token in stop_ids:
                        finish = "stop"
                        break
                    emitted.append(token)
                    if text.add(token):
                        finish = "stop"
                        break
                    if stats.completion_tokens >= max_tokens:
                        finish = "length"
                        break
                stats.decode_s = time.perf_counter() - t_decode
                if finish is not None and session is not None and hasattr(session, "finish"):
                    session.finish(context[:length])  # a finished completion feeds the online overlay
                yield GenerationChunk(emitted, text.take(final=finish is not None), finish, stats)
                if finish is not None or (cancelled is not None and cancelled()):
                    return

                pending = int(context[length - 1])
                n, draft = 0, None
                room = min(max_tokens - stats.completion_tokens - 1, self.policy.max_draft)
                if session is not None and room > 0:
                    t = time.perf_counter()
                    draft = session.propose(context[:length], room)
                    if len(draft):
                        stats.drafts += 1
                        n, probe = self.policy.choose(draft.confidence[:room], draft.match_length, tracker)
                    stats.draft_s += time.perf_counter() - t
                t = time.perf_counter()
                if n > 0:
                    proposal = [int(x) for x in draft.tokens[:n]]
                    new = (fast.verify(pending, proposal) if fast is not None
                           else verify(model, cache, pending, proposal))
                    accepted = len(new) - 1
                    stats.verify_steps += 1
                    stats.probes += probe
                    stats.drafted_tokens += n
                    stats.accepted_tokens += accepted
                    tracker.record(n, accepted, probe)
                    session.feedback(n, accepted)
                else:
                    logits = fast.decode_one(pending) if fast is not None else decode_one(model, cache, pending)
                    new = [self._pick(logits, params, generator)]
                    stats.plain_steps += 1
                stats.forward_s += time.perf_counter() - t

    @staticmethod
    def _pick(logits: torch.Tensor, params: GenerationParams, generator) -> int:
        if params.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
