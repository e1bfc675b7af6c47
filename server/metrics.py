"""Server metrics in the Prometheus text format (`GET /metrics`).

Contract: `Metrics.record(...)` is called once per finished request (from the event loop);
`Metrics.render(waiting, running, prefix, batching, prompt_tokens)` returns the exposition text
(`prefix`: the backend's prefix-cache summary, or None when the cache is off; `batching`: the shared
forwards' counters; `prompt_tokens`: the prompt tokenizer's, common.prompt_tokens). The
speculative-decoding counters carry the names existing tooling reads (vLLM's, unprefixed):
`spec_decode_num_drafts_total`, `spec_decode_num_draft_tokens_total`,
`spec_decode_num_accepted_tokens_total`. Latencies are histograms in seconds.
"""
from __future__ import annotations

import bisect
from collections import defaultdict

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


# (name, help) of the plain counters; values live in Metrics.counters
COUNTERS = (
    ("spec_decode_num_drafts_total", "Verify steps that checked a drafted sequence."),
    ("spec_decode_num_draft_tokens_total", "Drafted tokens verified by the target."),
    ("spec_decode_num_accepted_tokens_total", "Drafted tokens the target accepted and the request output "
     "(not those past its end)."),
    ("sailfish_prompt_tokens_total", "Prompt tokens prefilled."),
    ("sailfish_generation_tokens_total", "Tokens generated (completion tokens)."),
    ("sailfish_verify_steps_total", "Target forwards that verified a draft."),
    ("sailfish_plain_steps_total", "Target forwards that decoded one token without a draft."),
    ("sailfish_chained_steps_total", "Plain steps that launched the next step on the GPU from their argmax, "
     "before the host read it."),
    ("sailfish_internal_errors_total", "Requests answered with a 500 (an unexpected exception, logged)."),
    ("sailfish_prefix_cache_hits_total", "Requests whose prompt reused a kept prefix."),
    ("sailfish_prefix_cache_reused_tokens_total", "Prompt tokens whose KV came from the prefix cache."),
    ("sailfish_prefix_cache_computed_tokens_total", "Prompt tokens computed (prefilled)."),
)
# (name, help, key in the backend's prefix summary) of the prefix cache's gauges
PREFIX_GAUGES = (
    ("sailfish_prefix_cache_bytes", "Memory the kept sequences use.", "bytes"),
    ("sailfish_prefix_cache_budget_bytes", "The prefix cache's memory budget.", "budget_bytes"),
    ("sailfish_prefix_cache_peak_bytes", "The most memory the kept sequences ever used.", "peak_bytes"),
    ("sailfish_prefix_cache_entries", "Kept sequences.", "entries"),
    ("sailfish_prefix_cache_evictions", "Kept sequences evicted to stay within the budget.", "evictions"),
)
HISTOGRAMS = (
    ("sailfish_request_latency_seconds", "Time from arrival to the last token."),
    ("sailfish_time_to_first_token_seconds", "Time from arrival to the first generated token."),
    ("sailfish_queue_wait_seconds", "Time a request waited for the engine."),
)


# Requests sharing forwards (server/batcher.py): name, type, help, key of StepBatcher.summary().
BATCH_SERIES = [
    ("sailfish_batch_forwards_total", "counter", "Forwards run for running requests together.", "forwards"),
    ("sailfish_batch_sequences_total", "counter", "Requests' steps those forwards carried (sum over forwards).",
     "sequences"),
    ("sailfish_batch_rows_total", "counter", "Token rows those forwards carried (sum over forwards).", "rows"),
    ("sailfish_batch_size_last", "gauge", "Requests in the last forward.", "last_sequences"),
    ("sailfish_batch_size_peak", "gauge", "Most requests in one forward so far.", "peak_sequences"),
]

# Prompt tokenization (common/prompt_tokens.py): name, type, help, key of PromptTokens.summary().
PROMPT_TOKENIZER_SERIES = [
    ("sailfish_prompt_tokenizer_reused_tokens_total", "counter",
     "Prompt tokens taken from a recent prompt's tokenization instead of tokenized again.", "reused_tokens"),
    ("sailfish_prompt_tokenizer_encoded_tokens_total", "counter", "Prompt tokens tokenized.", "encoded_tokens"),
    ("sailfish_prompt_tokenizer_kept_prompts", "gauge", "Recent prompts kept for their tokens.", "kept"),
]


class Metrics:
    def __init__(self) -> None:
        self.counters = {name: 0 for name, _ in COUNTERS}
        self.requests: dict[tuple[str, str], int] = defaultdict(int)   # (endpoint, outcome) -> count
        self.histograms = {name: Histogram() for name, _ in HISTOGRAMS}

    def record(self, endpoint: str, outcome: str, stats=None, latency: float | None = None,
               ttft: float | None = None, queue_wait: float | None = None) -> None:
        """outcome: "ok", "cancelled", "error" or "rejected" (a 429). `stats` is the engine's RequestStats, if it ran."""
        self.requests[(endpoint, outcome)] += 1
        if stats is not None:
            c = self.counters
            c["spec_decode_num_drafts_total"] += stats.verify_steps
            c["spec_decode_num_draft_tokens_total"] += stats.drafted_tokens
            c["spec_decode_num_accepted_tokens_total"] += stats.accepted_tokens
            c["sailfish_prompt_tokens_total"] += stats.prompt_tokens
            c["sailfish_generation_tokens_total"] += stats.completion_tokens
            c["sailfish_verify_steps_total"] += stats.verify_steps
            c["sailfish_plain_steps_total"] += stats.plain_steps
            c["sailfish_chained_steps_total"] += stats.chained_steps
            c["sailfish_prefix_cache_hits_total"] += stats.cached_tokens > 0
            c["sailfish_prefix_cache_reused_tokens_total"] += stats.cached_tokens
            c["sailfish_prefix_cache_computed_tokens_total"] += stats.prompt_tokens - stats.cached_tokens
        for name, value in (("sailfish_request_latency_seconds", latency),
                            ("sailfish_time_to_first_token_seconds", ttft),
                            ("sailfish_queue_wait_seconds", queue_wait)):
            if value is not None:
                self.histograms[name].observe(value)

    def internal_error(self) -> None:
        self.counters["sailfish_internal_errors_total"] += 1

    def render(self, waiting: int, running: int, prefix: dict | None = None, batching: dict | None = None,
               prompt_tokens: dict | None = None) -> str:
        out = ["# HELP sailfish_requests_total Requests finished, by endpoint and outcome.",
               "# TYPE sailfish_requests_total counter"]
        for (endpoint, outcome), n in sorted(self.requests.items()):
            out.append(f'sailfish_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} {n}')
        for name, help_text in COUNTERS:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {self.counters[name]}"]
        for name, help_text in (("sailfish_requests_waiting", "Requests queued for the engine."),
                                ("sailfish_requests_running", "Requests the engine is generating.")):
            value = waiting if name.endswith("waiting") else running
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
        for name, help_text, key in PREFIX_GAUGES if prefix is not None else ():
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {prefix.get(key, 0)}"]
        for series, values in ((BATCH_SERIES, batching), (PROMPT_TOKENIZER_SERIES, prompt_tokens)):
            for name, kind, help_text, key in series if values is not None else ():
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {values.get(key, 0)}"]
        for name, help_text in HISTOGRAMS:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"] + self.histograms[name].lines(name)
        return "\n".join(out) + "\n"
