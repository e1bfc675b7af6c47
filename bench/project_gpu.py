"""Projected E4B tokens/s per workload on the GPU: `python -m bench.project_gpu`.

Reads two measured results files and combines them; nothing is typed in:
- bench/results/gpu_e4b.json: the fast path's forward time for 1..16 new tokens at 1k context (H200,
  E4B shape, int4 weights, bf16);
- replay figures: bench/results/ngram.json (BFCL v4 held-out turns, i.e. what a tool-calling model
  emitted: the better proxy for E4B's own tool calls) and bench/results/bench.json (the bundled 270M
  base model's own outputs per workload: inflated by its looping), and its sampled-decoding runs
  (tokens per engine step and drafted tokens per step under each sampling preset).
Projection per workload: a replayed step verifies d drafted tokens on average (drafted tokens / steps)
and yields tau tokens, so tokens/s = tau / t(1 + d), with t(n) the measured forward time for n new
tokens (d rounded up). Plain decoding is 1 / t(1). Written to bench/results/gpu_projection.{json,md}.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from bench.results import write_results

RESULTS = Path("bench/results")


def project(replay: dict, curve: dict) -> dict:
    d = replay["drafted_tokens"] / max(replay["verify_steps"], 1)
    n = min(16, 1 + math.ceil(d))
    return {"tau": replay["tau"], "drafted_per_step": d, "step_ms": curve[str(n)] * 1000,
            "projected_tok_s": replay["tau"] / curve[str(n)]}


def main() -> int:
    gpu = json.loads((RESULTS / "gpu_e4b.json").read_text())
    curve = gpu["fast_curve_s"]["1k"]
    rows = {}
    ngram = json.loads((RESULTS / "ngram.json").read_text())
    for group, r in ngram["replay"].items():
        rows[f"BFCL held-out, {group} (ground-truth turns)"] = project(r["sailfish"], curve)
    bench_path = RESULTS / "bench.json"
    if bench_path.exists():
        bench = json.loads(bench_path.read_text())
        for workload, r in bench["replay"].items():
            rows[f"{workload} (270M base model's own outputs)"] = project(r["sailfish"], curve)
    # drafted sampling: the engine's own steps, from `make bench` or `python -m bench --sampled-only`
    for path in (bench_path, RESULTS / "bench-sampled.json"):
        if path.exists():
            for preset, per in json.loads(path.read_text()).get("sampled", {}).items():
                for workload, r in per.items():
                    rows[f"{workload}, sampled {preset} (270M engine steps, same seeds)"] = project(r, curve)
    plain = 1 / curve["1"]
    lines = [f"Plain decoding on the fast path: {plain:.0f} tokens/s (1 / t(1), t(1) = {curve['1'] * 1000:.2f} ms, "
             f"H200, E4B shape, int4, 1k context).", "",
             "| workload (replay source) | tau | drafted per step | step ms | projected tokens/s | x plain |",
             "|---|---|---|---|---|---|"]
    for name, p in rows.items():
        lines.append(f"| {name} | {p['tau']:.2f} | {p['drafted_per_step']:.1f} | {p['step_ms']:.2f} | "
                     f"{p['projected_tok_s']:.0f} | {p['projected_tok_s'] / plain:.2f} |")
    md = "\n".join(lines) + "\n"
    write_results(RESULTS, "gpu_projection", {"plain_tok_s": plain, "rows": rows}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
