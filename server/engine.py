"""The target engine: decoding of requests, with drafts (chains or token trees) verified losslessly.

Contract: `Engine.generate(prompt_ids, params)` yields `GenerationChunk`s whose tokens are exactly
what plain decoding of the target yields (same stop tokens, stop strings and max_tokens; greedy,
or sampled with the same seed), whether or not drafts are used, whether or not the prompt's prefix
came from the prefix cache, and whatever other requests run beside it; drafting only changes how
many forward passes it takes, and the cache how many prompt tokens are computed. The engine works
on token ids; the tokenizer is used only to detokenize for stop strings and text deltas. Up to
`engine.parallel` threads may call `generate` at once (the server's scheduler runs that many
workers): each request takes a backend lane of its own, the free one whose cache holds most of its
prompt (server/lane_pool.py). The CPU int8 path's lanes share forwards (server/batcher.py), and so
do the GPU fast path's when asked (--parallel N: server/fast_batch.py, a cache per lane); transformers'
path has one lane, and a second call waits for it.

The engine talks to the model only through a `server.backend.Backend`: the GPU fast path
(`server.fast_path.FastTarget`: static KV cache, CUDA graphs) where it applies, else transformers
(`server.eager_backend.EagerBackend`); `engine.notes` says which runs and why. Both keep finished
sequences for prefix reuse under a memory budget (`EngineConfig.prefix_cache_bytes`, default
sized from free memory; `prefix_cache=False` is the old behaviour, every prompt from position 0).

One step of the loop: the last committed token is "pending" (not yet in the KV cache). A plain step
feeds it alone; a verify step feeds it followed by n drafted tokens and rolls the cache back past
the first rejected token (`server.backend.accept` is the rule). Where the backend's steps return
before their forward has run (`async_steps`: the GPU fast path's graph replays) each step is launched
as soon as the tokens before it are committed as tokens, before their text is decoded, stop strings
checked and the chunk handed out (`EngineConfig.launch_early`), so that host work overlaps the
forward; a stop string found then takes back the tokens after it, and the launched step is rolled
back with them. Plain greedy requests (no drafts, no grammar, the raw argmax choosing) go one step
further where the backend chains steps on the device (`chains_steps`: a lone fast-path target's
graphs, not lanes): each step is launched from the argmax the step before left on the GPU before
the host reads that token (`step_after_argmax`), so the host's round trip (reading the token,
staging and launching the next step) no longer sits between two steps; a request that ends at a
token has one step more launched, which its end rolls back. Drafting requests chain so too during a
drought (`DROUGHT_STEPS` plain steps in a row with no draft worth verifying): the drafter is still
asked at every step, while the chained step runs, and the first draft worth verifying ends the chain
(that step stays plain, the next one drafts). A token tree (where the backend takes
trees and no grammar applies) feeds the pending token, its main chain's first n tokens and the
branches the cost model keeps; each row's token is chosen as plain decoding would choose it after
that row's path, the child drafting it is followed, and the backend keeps that root path. When the request ends (finished, cancelled or
disconnected) the KV of the committed tokens is handed back to the backend for reuse;
after an error inside a forward it is discarded.

Constrained decoding (`GenerationParams.constraint`, a server.grammar.Constraint): every token is
chosen from logits whose grammar-disallowed tokens are -inf (the prefill's first token, plain steps
and every verify row alike), drafts are cut to the prefix the grammar accepts before they are
verified, and generation stops ("stop") once the grammar is complete. The request's matcher always
equals the committed tokens between steps: a verify step advances it through the accepted drafted
tokens (row j is masked by the state after pending + draft[:j]) and rolls it back afterwards, and
the commit loop consumes each committed token. The token at a position is the same function of the
logits, the tokens before it and (seed, position) as without drafting, so drafting stays lossless.

Counters: `drafts` = non-empty drafts proposed (after the grammar's cut), `verify_steps` = forwards
that verified a draft, `plain_steps` = one-token forwards, `drafted_tokens` / `accepted_tokens` =
drafted tokens verified / accepted (those accepted past the request's end, a stop token, a stop string,
a complete grammar or max_tokens, not counted: at most `completion_tokens`), `completion_tokens` = generated tokens including a final stop
token (which is never emitted), `cached_tokens` = prompt tokens reused from the prefix cache,
`grammar_cut_tokens` = drafted tokens the grammar rejected before verification, `grammar_s` = time
in the grammar (masks, advancing, draft checks; inside `forward_s` and `draft_s`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator

import numpy as np
import torch

from ngram.draft import Draft, Drafter
from server.backend import Backend, accept, curves_agree, kept_curve_check, measure_cost_curve
from server.cost_model import AcceptanceTracker, DraftPolicy, flat_policy
from server.engine_config import EngineConfig
from server.grammar import Constraint, GrammarMatcher
from server.lane_pool import LanePool
from server.sampling import Sampler, SamplingParams, row_argmax, row_of

log = logging.getLogger("sailfish.engine")

# After this many plain steps in a row whose drafter had nothing worth verifying (an empty draft, or
# one the cost policy refused without a probe), a drafting request chains its plain steps on the
# device as a request without drafts does (`_complete`, `step_after_argmax`), asking the drafter
# while the chained step runs. The cost: when a draft worth verifying comes back, the step already
# launched from the last token is a plain one, so about one step's progress is lost per drought;
# at a 3.4 ms step and 0.37 ms saved per chained step that breaks even at about 9 chained steps, a
# drought of about 8 + 9 plain steps. At least 1 (0 would chain forever, never drafting); None turns
# the rule off (A/B runs).
DROUGHT_STEPS: int | None = 8


@dataclass
class GenerationParams:
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    # Stop strings matched only outside the tool calls in the generated text, where `call_markers`
    # (open, close) says where calls are: the request's own, when it enforces its calls (server/serving.py
    # prepare_chat: a cut call would break that promise). `stop_strings` (the format's end markers, and a
    # request's own otherwise) end generation anywhere. `in_call`: the prompt ends inside a call (a
    # forced call's start). Without markers these apply everywhere.
    text_stop_strings: tuple[str, ...] = ()
    call_markers: tuple[str, str] | None = None
    in_call: bool = False
    draft: bool = True          # False = plain decoding, the baseline
    sampling: SamplingParams = SamplingParams()  # greedy by default; sampled requests are drafted too
    prefix_cache: bool = True   # False: compute the whole prompt and keep nothing
    constraint: Constraint | None = None  # a grammar the output must follow (server.grammar)


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache
    completion_tokens: int = 0
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    chained_steps: int = 0      # plain steps that launched the next one on the device (step_after_argmax)
    probes: int = 0
    grammar_cut_tokens: int = 0  # drafted tokens the grammar rejected, never verified
    tree_steps: int = 0         # verify steps over a token tree (branches beside the main chain)
    prefill_s: float = 0.0
    decode_s: float = 0.0       # wall time after the prefill, everything included
    draft_s: float = 0.0        # drafter.propose + the draft/no-draft decision
    forward_s: float = 0.0      # model forwards (decode and verify) and their argmax
    grammar_s: float = 0.0      # grammar masks, advancing and draft checks (part of the two above)

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
    stop_string: str | None = None  # the stop string that ended generation (finish "stop"), if one did


# ---------------------------------------------------------------- text: deltas and stop strings

class TextStream:
    """Incremental detokenization with stop strings. Deltas are decoded against a few tokens of
    left context so that leading spaces and multi-byte characters come out exactly once.
    `text_stops` are stop strings that match only outside tool calls (GenerationParams)."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...], prompt_tail: list[int],
                 text_stops: tuple[str, ...] = (), call_markers: tuple[str, str] | None = None,
                 in_call: bool = False):
        self._decode = _raw_decode(tokenizer)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.text_stops = tuple(s for s in text_stops if s)
        self.call_markers, self.starts_in_call = call_markers, in_call
        self.ids = list(prompt_tail)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0
        self.stopped_by: str | None = None  # the stop string `add` cut the text at

    def add(self, token: int) -> bool:
        """Append a token; True when a stop string is complete (the text is cut before it)."""
        self.ids.append(token)
        decode = self._decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete multi-byte character: wait for the next token
        before = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hit = first_stop(self.text, before, self.stop_strings, self.text_stops, self.call_markers, self.starts_in_call)
        if hit is not None:
            cut, self.stopped_by = hit
            self.text = self.text[:cut]
            return True
        return False

    def take(self, final: bool) -> str:
        """The text not handed out yet, holding back a tail that may still become a stop string."""
        end = len(self.text)
        if not final:
            for stop in self.stop_strings + self.text_stops:
                for j in range(min(len(stop) - 1, end - self.emitted), 0, -1):
                    if self.text.endswith(stop[:j]):
                        end = min(end, len(self.text) - j)
                        break
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta


def first_stop(text: str, since: int, stops: tuple[str, ...], text_stops: tuple[str, ...] = (),
               call_markers: tuple[str, str] | None = None, in_call: bool = False) -> tuple[int, str] | None:
    """(where, which) of the first stop string in `text` that ends past text[:since] (what was
    searched before), or None: any of `stops`, or one of `text_stops` outside a tool call (after a
    call's open marker and before its close; before the first marker, inside where `in_call`)."""
    def inside(at: int) -> bool:
        if call_markers is None:
            return False
        opened, closed = (text.rfind(marker, 0, at) for marker in call_markers)
        return in_call if opened == closed == -1 else opened > closed

    hits = []
    for stop in filter(None, stops + text_stops):
        i = text.find(stop, max(0, since - len(stop) + 1))
        while i >= 0 and stop in text_stops and stop not in stops and inside(i):
            i = text.find(stop, i + 1)
        if i >= 0:
            hits.append((i, stop))
    return min(hits, key=lambda hit: hit[0]) if hits else None


def _raw_decode(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text, special tokens kept: the fast tokenizer's own (Rust) decode where transformers'
    `decode` would add nothing to it (its `_decode` is TokenizersBackend's, which is the Rust call
    and an optional clean-up of spaces, here off), about 2.5x cheaper a call (two calls a generated
    token, inside every step's host work); else transformers' `decode` (a class that overrides
    either, a slow tokenizer, the clean-up on)."""
    rust = getattr(tokenizer, "_tokenizer", None)
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its decode, whatever it does
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    cls = type(tokenizer)
    plain = (isinstance(tokenizer, TokenizersBackend) and rust is not None
             and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode
             and not getattr(tokenizer, "clean_up_tokenization_spaces", True))
    if plain:
        return lambda ids: rust.decode(ids, skip_special_tokens=False)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------- the engine

class Engine:
    def __init__(self, target, drafter: Drafter | None = None, config: EngineConfig | None = None,
                 backend: Backend | None = None):
        self.config = config or EngineConfig()
        self.target = target
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.model_id = target.model_id
        text_config = self.model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_context = self.config.max_context or text_config.max_position_embeddings
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self._drafter = drafter
        self.notes: list[str] = []
        self.backend = backend if backend is not None else self._build_backend()
        self.max_context = min(self.max_context, self.backend.max_context)
        # token trees: verified in one step where the backend can (else only a tree's main chain is)
        self._trees = bool(getattr(self.backend, "supports_tree", False))
        if self.backend.max_step - 1 < self.config.max_draft:
            self.notes.append(f"drafts capped at {self.backend.max_step - 1} tokens (the backend's largest step "
                              f"is {self.backend.max_step}; max_draft was {self.config.max_draft})")
            self.config = replace(self.config, max_draft=self.backend.max_step - 1)
        if not self.config.adaptive:
            self.policy = flat_policy(self.config.max_draft)
        else:
            curve = self.config.cost_curve if self.config.cost_curve is not None else self._cost_curve()
            self.policy = DraftPolicy(np.asarray(curve, dtype=np.float64))
        self._totals = {name: 0 for name in ("requests", "completion_tokens", "drafts", "drafted_tokens",
                                             "accepted_tokens", "verify_steps", "plain_steps", "chained_steps", "probes",
                                             "cached_tokens", "grammar_cut_tokens", "tree_steps")}
        self._totals.update(prefill_s=0.0, decode_s=0.0, draft_s=0.0, forward_s=0.0, grammar_s=0.0)
        # Requests at once: one backend lane each (server/cpu_backend.py batches their forwards);
        # the drafter's shared state (index memo, overlay, context indexes) is used under one lock.
        lanes = self._lanes_of(self.backend)
        self.parallel = len(lanes)
        self._lanes = LanePool(lanes)  # a request gets the free lane whose cache holds most of its prompt
        self._lock = threading.Lock()
        self._draft_lock = threading.Lock()

    def _lanes_of(self, backend: Backend) -> list:
        from server.cpu_backend import CpuBackend
        from server.fast_path import FastTarget

        asked = self.config.parallel
        if isinstance(backend, CpuBackend):
            n = 4 if asked is None else max(1, int(asked))
            if n > 1:
                self.notes.append(f"parallel: {n} requests at once, their steps batched into shared forwards "
                                  "(--parallel to change)")
            return backend.lanes(n)
        if isinstance(backend, FastTarget) and asked is not None and asked > 1:
            # Only when asked: each lane holds a cache of its own (the memory plan fits them all).
            from server.fast_batch import fast_lanes

            self.notes.append(f"parallel: {asked} requests at once on the fast path, each with a cache of its own, "
                              "their steps batched into shared forwards")
            return fast_lanes(backend, int(asked))
        if asked is not None and asked > 1:
            self.notes.append(f"parallel: {type(backend).__name__} serves one request at a time "
                              f"(--parallel {asked} needs the CPU int8 path or the GPU fast path)")
        return [backend]

    def _cost_curve(self) -> np.ndarray:
        """The verify cost curve: kept from an earlier start under the same conditions, else measured
        (and kept when `cost_cache` is set). The notes say which."""
        from server.cost_cache import CostCurveCache, conditions

        cfg = self.config
        from server.fast_path import model_device

        device = model_device(self.model)  # the embedding may be on the host (the int8 LM head)
        cond = conditions(self.model_id, device, next(self.model.parameters()).dtype, type(self.backend).__name__,
                          cfg.max_draft + 1, cfg.cost_context)
        cache = CostCurveCache(cfg.cost_cache) if cfg.cost_cache is not None else None
        stale, kept = "", None
        if cache is not None and not cfg.remeasure_cost:
            kept = cache.get(cond)
            if kept is not None:
                holds, now = kept_curve_check(self.backend, self.vocab_size, kept, cfg.cost_context)
                last = len(kept) - 1
                checked = f"its {last}-token forward checked now: {now:.2f}x a step, kept {kept[last]:.2f}x"
                if holds:
                    self.notes.append(f"verify cost curve: kept from an earlier start ({cfg.cost_cache.name}; "
                                      f"{checked}; --remeasure-cost to measure again)")
                    return kept
                stale = checked
        t0 = time.perf_counter()
        curve = measure_cost_curve(self.backend, self.vocab_size, cfg.max_draft + 1, cfg.cost_context,
                                   progress=lambda message: log.info("%s", message))
        seconds = time.perf_counter() - t0
        if kept is not None and curves_agree(curve, kept):
            # The check timed a moment's noise: the whole curve, measured again, is the kept one's.
            self.notes.append(f"verify cost curve: kept from an earlier start ({cfg.cost_cache.name}; {stale}, but "
                              f"measured again in {seconds:.1f} s it agrees: {curve[-1]:.2f}x)")
            return kept
        self.notes.append(f"verify cost curve: measured in {seconds:.1f} s" +
                          (f", kept in {cfg.cost_cache}" if cache is not None else "") +
                          (f"; the one kept from an earlier start no longer held ({stale}; measured now "
                           f"{curve[-1]:.2f}x)" if stale else ""))
        if cache is not None:
            cache.put(cond, curve, seconds)
        return curve

    @property
    def fast(self):
        """The FastTarget when the GPU fast path serves, else None."""
        from server.fast_path import FastTarget
        return self.backend if isinstance(self.backend, FastTarget) else None

    def _prefix_budget(self, device: torch.device) -> int:
        """Bytes for kept sequences: the configured budget, else 20% of free memory, at most 8 GiB on the CPU."""
        if not self.config.prefix_cache:
            return 0
        if self.config.prefix_cache_bytes is not None:
            return int(self.config.prefix_cache_bytes)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(0.2 * free)
        return int(min(0.2 * _available_host_memory(), 8 * 2**30))

    def _build_backend(self) -> Backend:
        """The fast path when it applies (graphs captured here), else transformers; notes say why."""
        from server.eager_backend import EagerBackend
        from server.fast_path import model_device

        device = model_device(self.model)  # (an earlier fast path may have moved the embedding to the host)
        why_not = None
        if not self.config.fast_path:
            why_not = "eager path: fast path off (--no-fast-path)"
        elif device.type != "cuda":
            why_not = f"eager path: no CUDA (device {device.type}); the fast path needs CUDA graphs"
        else:
            from server.fast_path import unsupported_reason

            reason = unsupported_reason(self.model)
            why_not = f"eager path: {reason}" if reason is not None else None
        if why_not is None:
            return self._build_fast_path()
        gpu_only = [flag for flag, value in (("--gpu-memory-mb", self.config.gpu_memory_mb),
                                             ("--fast-max-context", self.config.fast_max_context),
                                             ("--lm-head", None if self.config.lm_head == "auto" else self.config.lm_head))
                    if value is not None]
        if gpu_only:  # they size the GPU fast path: refused rather than ignored where it does not run
            raise ValueError(f"{' and '.join(gpu_only)} {'shape' if len(gpu_only) > 1 else 'shapes'} the GPU fast "
                             f"path, which this run does not use ({why_not})")
        budget = self._prefix_budget(device)
        if device.type == "cpu" and self.config.cpu_int8:
            from server.cpu_model import unsupported_reason as cpu_unsupported

            reason = cpu_unsupported(self.model)
            if reason is None:
                return self._build_cpu_int8(budget)
            why_not += f"; the CPU int8 path {reason}"
        elif device.type == "cpu":
            why_not += "; the CPU int8 path is off (--no-cpu-int8)"
        self.notes.append(why_not)
        if device.type == "cuda":  # transformers' forward reads every table on the card
            from server.model_loading import move_host_tables

            move_host_tables(self.model, device)
        backend = EagerBackend(self.model, budget, max_context=self.max_context, max_step=self.config.max_draft + 1)
        self.notes.append(_prefix_note(budget))
        return backend

    def _build_cpu_int8(self, budget: int) -> Backend:
        from server import cpu_kernels
        from server.cpu_backend import CpuBackend
        from server.cpu_model import CpuGemma

        backend = CpuBackend(CpuGemma.from_hf(self.model), self.max_context, budget, max_step=self.config.max_draft + 1)
        self.notes.append(f"CPU int8 path: {backend.model.nbytes() / 2**20:.0f} MiB of int8 weights, "
                          + ("C kernels" if cpu_kernels.AVAILABLE else "numpy kernels (the C extension is not built)"))
        self.notes.append(_prefix_note(budget))
        return backend

    def _build_fast_path(self):
        from server.fast_memory import plan_fast_memory, settle_after_warmup
        from server.fast_path import FastTarget, step_buckets

        cfg = self.config
        budget = (0 if not cfg.prefix_cache else cfg.prefix_cache_bytes)
        ple = getattr(self.model.model, "embed_tokens_per_layer", None)
        if ple is not None:  # Gemma 4's per-layer embeddings are looked up on the host: plan without them
            ple.to("cpu")
            torch.cuda.empty_cache()
        buckets = step_buckets(cfg.max_draft)  # only the steps this engine's drafts can take
        lanes = max(1, int(cfg.parallel or 1))  # --parallel N: N lanes, each with a cache (server/fast_batch.py)
        plan = plan_fast_memory(self.model, self.max_context, cfg.fast_max_context, budget, cfg.gpu_memory_bytes,
                                buckets, lanes=lanes, lm_head=cfg.lm_head)
        # A padded step may write up to one bucket past the last committed position: room for it.
        # The tables kept on the host are read by the GPU in place for a lone target (measured on the
        # H200, E4B: a 16-token verify 4.25 -> 4.17 ms, plain decode 272 -> 279 tokens/s; one drafted
        # agent stream 653-679 -> 702-743 tokens/s), and staged for lanes: 4 lanes gained with them
        # mapped (1643-1659 -> 1789-1798 tokens/s) but 16 lost (2461-2505 -> 1798-2091), their shared
        # forwards 6.9 -> 8.6-10.6 ms though such a forward alone was faster (16 x 2 rows 6.49 -> 6.05
        # ms); why is not known (docs/bars.md).
        fast = FastTarget(self.model, max_len=plan.context + buckets[-1], buckets=buckets,
                          min_kv_len=min(1024, plan.context), prefix_budget_bytes=plan.prefix_bytes,
                          ple_on_host=ple is not None, prefill_rows=plan.prefill_rows,
                          prefill_dense=plan.prefill_dense, lm_head_int8=plan.lm_head_int8,
                          map_host_tables=None if lanes == 1 else False)
        seconds = fast.warmup()
        seconds += fast.warm_prefill()
        settled = settle_after_warmup(fast, plan)
        self.notes.append(f"fast path: CUDA graphs, static cache ({fast.timings.graphs} graphs captured in "
                          f"{seconds:.1f} s; context {fast.max_context} tokens, KV cache "
                          f"{fast.cache_bytes() / 2**30:.2f} GiB; {plan.note}); {fast.step_kernel_note}; {fast.prefill_note}")
        if fast.host_table_note:
            self.notes.append(f"fast path: {fast.host_table_note}")
        if settled:
            self.notes.append(f"GPU memory: {settled}")
        self.notes.append(_prefix_note(plan.prefix_bytes))
        return fast

    def set_drafter(self, drafter: Drafter | None) -> None:
        self._drafter = drafter

    def totals(self) -> dict:
        return dict(self._totals)

    def prefix_summary(self) -> dict | None:
        return self.backend.prefix_summary()

    def batch_summary(self) -> dict | None:
        """The batcher's counters (server/batcher.py) when requests share forwards, else None."""
        batcher = getattr(self.backend, "batcher", None)
        return batcher.summary() if batcher is not None else None

    def generate(self, prompt_ids: list[int], params: GenerationParams,
                 cancelled: Callable[[], bool] | None = None) -> Iterator[GenerationChunk]:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_context}")
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        lane = self._lanes.take(prompt_ids)  # blocks while `parallel` requests run (the scheduler admits no more)
        try:
            yield from self._generate(prompt_ids, params, cancelled, stats, lane)
        finally:
            self._lanes.give(lane)
            with self._lock:
                self._totals["requests"] += 1
                for f in fields(RequestStats):
                    if f.name in self._totals:
                        self._totals[f.name] += getattr(stats, f.name)

    def _generate(self, prompt_ids, params, cancelled, stats, backend: Backend) -> Iterator[GenerationChunk]:
        max_tokens = min(params.max_tokens, self.max_context - len(prompt_ids))
        if max_tokens <= 0:
            yield GenerationChunk([], "", "length", stats)
            return
        stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids)
        text = TextStream(self.tokenizer, tuple(params.stop_strings), prompt_ids[-4:], tuple(params.text_stop_strings),
                          params.call_markers, params.in_call)
        drafter = self._drafter
        session = None
        if drafter is not None and params.draft:
            session = drafter.session() if self.parallel == 1 else _LockedSession(drafter.session(), self._draft_lock)
        req = _Request(backend, prompt_ids, max_tokens, stop_ids, Sampler(params.sampling, prompt_ids),
                       params.constraint.start(stop_ids) if params.constraint is not None else None, session, stats)
        # Launch each step before the text of the tokens before it is decoded and handed out, where
        # the backend's steps run while the host goes on (the GPU fast path's graphs): the text, the
        # stop strings and the consumer of the chunk then overlap the forward instead of delaying it.
        early = self.config.launch_early
        early = bool(getattr(backend, "async_steps", False)) if early is None else early
        # Plain greedy steps chain on the device where the backend can (`_complete`): no grammar, the
        # raw argmax chooses, so the next step's input is known on the device. (A launch earlier
        # still, so off wherever early launches are off.) Without drafts every step does; with a
        # drafter session only the plain steps of a drought (DROUGHT_STEPS).
        can_chain = (early and req.grammar is None and req.sampler.params.plain_argmax
                     and bool(getattr(backend, "chains_steps", False)))
        if can_chain and session is None:
            req.chain_after = 0   # no launch ever drafts: every plain step chains
        elif can_chain and DROUGHT_STEPS is not None:
            req.chain_after = max(1, DROUGHT_STEPS)
        clean = False  # the backend's cache is consistent at every yield, and only there
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                if session is not None:
                    session.prepare(prompt_ids)
                pre = backend.start(prompt_ids, reuse=params.prefix_cache)
                stats.cached_tokens = pre.reused
                new = [_choose(req.sampler, req.grammar, pre.logits, 0)]
                stats.prefill_s = time.perf_counter() - t0
                t_decode = time.perf_counter()
                while True:
                    # Commit one step's tokens one by one, exactly as plain decoding would: first as
                    # tokens (stop tokens, the grammar, max_tokens), then as text (stop strings).
                    first, finish = req.length, req.commit(new)
                    launched = None
                    if early and finish is None and not (cancelled is not None and cancelled()):
                        launched = self._launch(req)
                    emitted = []
                    for token in new[:req.length - first]:
                        if token in stop_ids:
                            break
                        emitted.append(token)
                        if text.add(token):  # a stop string: the request ends at this token
                            finish = "stop"
                            req.uncommit(first + len(emitted))
                            break
                    if finish is not None:  # drafted tokens accepted past the request's end were never output
                        stats.accepted_tokens -= max(0, req.step_accepted - (req.length - first))
                    stats.decode_s = time.perf_counter() - t_decode
                    if req.grammar is not None:
                        stats.grammar_s = req.grammar.seconds
                    if finish is not None and session is not None:
                        session.finish(req.context[:req.length])  # a finished completion feeds the online overlay
                    clean = True  # (a step launched early is past the committed tokens: finish rolls it back)
                    yield GenerationChunk(emitted, text.take(final=finish is not None), finish, stats,
                                          text.stopped_by if finish == "stop" else None)
                    if finish is not None or (cancelled is not None and cancelled()):
                        return
                    clean = False
                    new = self._complete(req, launched if launched is not None else self._launch(req))
        finally:
            if clean:
                # The KV holds every committed token but the last (still pending), plus any drafted
                # tokens accepted past a stop and a step launched early; keep exactly the committed ones.
                kept = req.length - 1
                if backend.position > kept:
                    backend.rollback(backend.position - kept)
                backend.finish(req.context[:kept], kept - len(prompt_ids))
            else:
                backend.discard()

    def _launch(self, req: "_Request") -> "_Launched":
        """The next step, drafted and handed to the backend: on the GPU fast path its forward runs
        while the host goes on; `_complete` reads its logits."""
        stats, backend, grammar = req.stats, req.backend, req.grammar
        chained, req.chained = req.chained, None  # launched by `_complete` on the device from the pending token
        if chained is not None and req.session is None:
            return chained
        pending = int(req.context[req.length - 1])
        n, draft, probe, cut = 0, None, 0, 0
        share = shared_room(backend)  # GPU lanes: the forward's rows are shared
        room = min(req.max_tokens - stats.completion_tokens - 1, self.policy.max_draft, share)
        if req.session is not None and room > 0:
            t = time.perf_counter()
            draft = req.session.propose(req.context[:req.length], room)
            if draft.parents is not None and (grammar is not None or not self._trees):
                draft = draft.main_chain()  # trees are verified only without a grammar
            if grammar is not None and len(draft):
                draft, cut = _grammar_cut(draft, grammar, room)
            if len(draft):
                chain = min(room, draft.chain_length())
                n, probe = self.policy.choose(draft.confidence[:chain], draft.match_length, req.tracker,
                                              shared_load(backend))
            stats.draft_s += time.perf_counter() - t
        req.drought = 0 if n > 0 else req.drought + 1
        if chained is not None:
            # A drought's chained step, already running and plain: the drafter is asked about this
            # position as the unchained launch would ask (on the host, while the GPU runs the step), and
            # a draft worth verifying, or a probe, ends the drought: `_complete` reads this step's token
            # on the host and the next launch drafts. The tracker sees this position's one `choose`, as
            # without chaining: a refusal it counts in `refused_since_probe` was one (the step is plain,
            # as a refused draft's is); a draft or probe it chose is neither verified nor recorded
            # (`record`, `feedback`, the verify counters), so a probe due by count stays due (the count
            # is reset only by a probe that runs) and runs at the next refused draft. The next launch
            # asks about the next position: none is asked, or counted, twice. Its draft counts in
            # `drafts` as a refused one does. The drought is left one step short of chaining, not
            # at 0: if the next position has nothing worth verifying either (a one-off draft, or a
            # probe due that finds no draft to run on), its plain step chains again at once rather
            # than after DROUGHT_STEPS more; a draft verified there resets it to 0.
            if n > 0:
                req.drought = req.chain_after - 1
            chained.drafted, chained.cut = int(draft is not None and len(draft) > 0), cut
            return chained
        t = time.perf_counter()
        branches = (self.policy.tree_branches(draft.parents, draft.confidence, draft.chain_length(), n,
                                              req.tracker.alpha, min(backend.max_step - 1, share), room)
                    if n > 0 and draft.parents is not None else [])
        launched = _Launched(draft is not None and len(draft) > 0, cut, n, probe)
        if branches:
            launched.tree = _TreeStep(draft, n, branches)
            launched.logits = backend.step([pending, *launched.tree.tokens], parents=launched.tree.row_parents)
        elif n > 0:
            launched.proposal = [int(x) for x in draft.tokens[:n]]
            launched.logits = backend.step([pending, *launched.proposal])
        else:
            launched.logits = backend.step([pending])
        launched.forward_s = time.perf_counter() - t
        return launched

    def _complete(self, req: "_Request", launched: "_Launched") -> list[int]:
        """The launched step's new tokens, chosen from its logits as plain decoding would choose
        them; the backend rolled back past the first rejected token, the counters updated."""
        stats, backend, sampler, n = req.stats, req.backend, req.sampler, launched.n
        t = time.perf_counter()
        stats.drafts += launched.drafted
        stats.grammar_cut_tokens += launched.cut
        if launched.tree is not None:
            tree = launched.tree
            path, token = tree.verify(sampler, launched.logits, stats.completion_tokens)
            backend.keep_path([0, *path])
            new = [tree.tokens[r - 1] for r in path] + [token]
            accepted, on_chain = len(path), tree.on_chain(path)
            stats.tree_steps += 1
        elif n > 0:
            proposal = launched.proposal
            accepted, token = _verify(sampler, req.grammar, launched.logits, proposal, stats.completion_tokens)
            backend.rollback(n - accepted)
            new = proposal[:accepted] + [token]
            on_chain = accepted
        elif (req.chain_after is not None and req.drought >= req.chain_after
              and stats.completion_tokens + 1 < req.max_tokens):
            # The argmax chosen on the device and the next one-token step launched from it before the
            # host reads it (server/fast_path.py step_after_argmax): the same token, and the step the
            # next `_launch` would make (in a drought, unless the drafter then has a draft worth
            # verifying: that step stays plain), with no wait for the host between them. A request that
            # ends at this token rolls that step back as it does an early launch.
            token, logits = backend.step_after_argmax(launched.logits)
            req.chained = _Launched(False, 0, 0, 0)
            req.chained.logits = logits
            new = [token]
            stats.plain_steps += 1
            stats.chained_steps += 1
        else:
            new = [_choose(sampler, req.grammar, row_of(launched.logits, 0), stats.completion_tokens)]
            stats.plain_steps += 1
        req.step_accepted = accepted if n > 0 else 0  # (the first of `new`, all drafted)
        if n > 0:
            stats.verify_steps += 1
            stats.probes += launched.probe
            stats.drafted_tokens += len(launched.tree.tokens) if launched.tree is not None else n  # (+ branches)
            stats.accepted_tokens += accepted
            req.tracker.record(n, on_chain, launched.probe)
            req.session.feedback(n, on_chain)
        stats.forward_s += launched.forward_s + time.perf_counter() - t
        return new


class _Request:
    """One request's decoding state: its committed tokens (`context[:length]`; the last one is
    pending, not yet in the backend's cache), its sampler, grammar, drafter session and counters."""

    def __init__(self, backend, prompt_ids: list[int], max_tokens: int, stop_ids: frozenset[int], sampler: Sampler,
                 grammar: GrammarMatcher | None, session, stats: RequestStats):
        self.backend, self.max_tokens, self.stop_ids = backend, max_tokens, stop_ids
        self.sampler, self.grammar, self.session, self.stats = sampler, grammar, session, stats
        self.context = np.zeros(len(prompt_ids) + max_tokens, dtype=np.int32)
        self.context[:len(prompt_ids)] = prompt_ids
        self.length = len(prompt_ids)
        self.tracker = AcceptanceTracker()
        self.step_accepted = 0  # drafted tokens the last step accepted (the first of its new tokens)
        # Plain greedy steps chain on the device (Engine._complete) once `drought` reaches this: 0
        # without a drafter session, DROUGHT_STEPS with one; None: never
        self.chain_after: int | None = None
        self.drought = 0        # launches in a row with no draft worth verifying (see Engine._launch)
        self.chained: _Launched | None = None  # the step so launched, for the next Engine._launch

    def commit(self, new: list[int]) -> str | None:
        """Commit `new` token by token until one ends the request: a stop token ("stop", counted,
        never emitted), a complete grammar ("stop") or max_tokens ("length"); that finish, or None.
        Stop strings are the caller's (the text), which may take tokens back (`uncommit`)."""
        stats, grammar = self.stats, self.grammar
        for token in new:
            stats.completion_tokens += 1
            self.sampler.commit(token)
            self.context[self.length] = token
            self.length += 1
            if token in self.stop_ids:
                return "stop"
            if grammar is not None:
                grammar.consume(token)
                if grammar.is_stopped():
                    return "stop"  # the grammar is complete: nothing but a stop token may follow
            if stats.completion_tokens >= self.max_tokens:
                return "length"
        return None

    def uncommit(self, length: int) -> None:
        """The request ended at a stop string completed by the token before `length`: the tokens
        committed after it were never generated (the request ends here; the sampler and the grammar
        are not used again)."""
        self.stats.completion_tokens -= self.length - length
        self.length = length


class _Launched:
    """A step handed to the backend: what `Engine._complete` needs to verify its logits."""

    __slots__ = ("drafted", "cut", "n", "probe", "tree", "proposal", "logits", "forward_s")

    def __init__(self, drafted: bool, cut: int, n: int, probe: int):
        self.drafted, self.cut, self.n, self.probe = int(drafted), cut, n, probe
        self.tree = self.proposal = self.logits = None
        self.forward_s = 0.0


def _choose(sampler: Sampler, grammar: GrammarMatcher | None, logits: torch.Tensor, position: int,
            pending: list[int] | tuple = ()) -> int:
    """The token of output position `position`: the sampler's choice among the tokens the grammar
    allows in its current state (every token without a grammar)."""
    if grammar is not None:
        logits = grammar.mask_logits(logits)
    return sampler.pick(logits, position, pending)


def shared_room(backend) -> int:
    """The most drafted tokens a step should carry beside the requests that shared the backend's
    last forward (GPU lanes: server/fast_path.py FastTarget.shared_room), else no bound."""
    room = getattr(backend, "shared_room", None)
    return room(shared_load(backend)) if room is not None else 1 << 30


def shared_load(backend) -> tuple[int, int]:
    """(requests, rows) of the other requests sharing the backend's forwards (server/batcher.py)."""
    load = getattr(backend, "shared_load", None)
    return load() if load is not None else (0, 0)


class _LockedSession:
    """A drafter session whose calls hold the drafter's lock: requests running at once share the
    drafter's memo dicts, overlay and context-index cache."""

    def __init__(self, session, lock: threading.Lock):
        self._session, self._lock = session, lock

    def prepare(self, context_ids) -> None:
        with self._lock:
            self._session.prepare(context_ids)

    def propose(self, context_ids, max_tokens: int) -> Draft:
        with self._lock:
            return self._session.propose(context_ids, max_tokens)

    def feedback(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self._session.feedback(drafted, accepted)

    def finish(self, context_ids=None) -> None:
        with self._lock:
            self._session.finish(context_ids)


class _TreeStep:
    """A verify step over a token tree: rows [pending, main chain[:n], branch nodes]; `verify`
    walks it from the pending token, at each row choosing the token plain decoding would choose
    there (server.sampling: the row's logits, its output position, the path's tokens before it)
    and following the child that drafted it."""

    def __init__(self, draft: Draft, n: int, branches: list[int]):
        nodes = list(range(n)) + branches
        row_of = {node: r + 1 for r, node in enumerate(nodes)}
        self.tokens = [int(draft.tokens[i]) for i in nodes]
        self.row_parents = [-1] + [row_of.get(draft.parents[i], 0) for i in nodes]
        self.chain_rows = n
        self.children: dict[int, dict[int, int]] = {}
        for r in range(1, len(self.row_parents)):
            self.children.setdefault(self.row_parents[r], {}).setdefault(self.tokens[r - 1], r)

    def verify(self, sampler: Sampler, logits: torch.Tensor, position: int) -> tuple[list[int], int]:
        """(rows of the accepted path, the step's new token)."""
        greedy = sampler.params.plain_argmax
        choices = row_argmax(logits) if greedy else None
        path: list[int] = []
        row = 0
        while True:
            prior = [self.tokens[r - 1] for r in path]
            token = choices[row] if greedy else sampler.pick(logits[row], position + len(path), prior)
            child = self.children.get(row, {}).get(token)
            if child is None:
                return path, token
            path.append(child)
            row = child

    def on_chain(self, path: list[int]) -> int:
        """How many of the accepted rows are the main chain's (rows 1..n, a prefix of the path)."""
        k = 0
        while k < len(path) and path[k] == k + 1 and k < self.chain_rows:
            k += 1
        return k


def _grammar_cut(draft: Draft, grammar: GrammarMatcher, room: int) -> tuple[Draft, int]:
    """(the draft's longest prefix, up to `room` tokens, that the grammar accepts from its state;
    how many of the offered tokens it cut)."""
    offered = min(len(draft), room)
    valid = grammar.validate_tokens(draft.tokens[:offered])
    cut = offered - valid
    if valid == len(draft):
        return draft, cut
    return Draft(draft.tokens[:valid], draft.confidence[:valid], draft.source, draft.match_length), cut


def _verify(sampler: Sampler, grammar: GrammarMatcher | None, logits: torch.Tensor, proposal: list[int],
            position: int) -> tuple[int, int]:
    """(accepted drafted tokens, the step's new token) for logits [1 + len(proposal), vocab] of
    [pending, *proposal], whose row j chooses output position `position + j`. Each row's token is
    chosen exactly as a plain step would choose it there (server.sampling; under a grammar, masked
    by the grammar state after the committed tokens and proposal[:j]); drafted tokens are accepted
    while they equal those choices, and the first choice that differs is the new token. The grammar
    is advanced through the accepted tokens and rolled back before returning: it is left as it was."""
    if grammar is None and sampler.params.plain_argmax:  # one vectorized argmax, then server.backend's rule
        target = row_argmax(logits)
        k = accept(proposal, target)
        return k, target[k]
    advanced, result = 0, None
    for j, drafted in enumerate(proposal):
        token = _choose(sampler, grammar, logits[j], position + j, proposal[:j])
        if token != drafted:
            result = (j, token)
            break
        if grammar is not None:
            grammar.consume(token)
            advanced += 1
    else:
        n = len(proposal)
        result = (n, _choose(sampler, grammar, logits[n], position + n, proposal))
    if grammar is not None:
        grammar.rollback(advanced)
    return result


def _prefix_note(budget: int) -> str:
    if budget <= 0:
        return "prefix cache: off (--no-prefix-cache): every prompt is prefilled from position 0"
    return (f"prefix cache: up to {budget / 2**30:.2f} GiB of kept sequences (--prefix-cache-mb to change, "
            f"--no-prefix-cache to turn off)")


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
