"""GPU prefill's masked softmax, A/B in one process: the Triton kernel the fast path ships
(server/fast_prefill.py `_softmax_rows`) against the compiled op it replaced (the step ops'
`masked_softmax`, compiled under inductor's deterministic mode), on the random-init E4B shape
(bench/gpu_e4b.py), fresh prompts of 8k and 64k tokens, alternating, `--rounds` of each.

Also: one 20k-token prompt's last logits both ways (the greedy token, and the relative
difference, which the random deep net amplifies from rounding: see the README's GPU notes).

Usage (GPU machine): python -m bench.prefill_softmax_ab [--rounds N] [--out DIR]
Writes DIR/prefill_softmax_ab.json and .md (default bench/results/)."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.results import write_results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_softmax_ab")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)

    import server.fast_prefill as prefill
    from bench.gpu_e4b import build_model, make_peaked, random_e4b_target
    from server.engine import Engine, EngineConfig

    model = build_model(quant=True)
    make_peaked(model)
    engine = Engine(random_e4b_target(model), None, EngineConfig(fast_max_context=70000))
    fast, vocab = engine.fast, model.config.vocab_size
    rng = np.random.default_rng(0)
    kernel = prefill._softmax_rows

    def compiled(scores, t, first, key0, window, scaling):  # what _attend did before the kernel
        S, dev = scores.shape[-1], scores.device
        kp = torch.arange(key0, key0 + S, device=dev)
        qp = torch.arange(first, first + t, device=dev)
        mask = kp[None, :] <= qp[:, None]
        if window:
            mask &= kp[None, :] > qp[:, None] - window
        return fast.ops.masked_softmax(scores, mask, scaling)

    def prefill_s(n: int) -> float:
        ids = rng.integers(3, vocab, n).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fast.start(ids, reuse=False).logits.float()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        fast.discard()
        return seconds

    ways = {"compiled op": compiled, "kernel": kernel}
    times = {n: {w: [] for w in ways} for n in (8192, 65536)}
    for n in times:
        for name, fn in ways.items():  # untimed: compiles each way's kernels for this length's shapes
            prefill._softmax_rows = fn
            prefill_s(n)
        for _ in range(args.rounds):
            for name, fn in ways.items():
                prefill._softmax_rows = fn
                times[n][name].append(prefill_s(n))
                print(name, n, f"{times[n][name][-1]:.3f} s", flush=True)
    ids = rng.integers(3, vocab, 20000).tolist()
    logits = {}
    for name, fn in ways.items():
        prefill._softmax_rows = fn
        logits[name] = fast.start(ids, reuse=False).logits.float()
        fast.discard()
    prefill._softmax_rows = kernel
    a, b = logits["compiled op"], logits["kernel"]
    same_token = a.argmax().item() == b.argmax().item()
    rel = ((a - b).norm() / a.norm()).item()
    results = {"device": torch.cuda.get_device_name(), "rounds": args.rounds, "seconds": times,
               "same_greedy_token_20k": same_token, "logits_rel_diff_20k": rel}
    lines = [f"# GPU prefill softmax: kernel vs compiled op ({results['device']}, E4B shape, int4, random init)", "",
             "| fresh prompt | compiled op s (median, range) | kernel s (median, range) | speed-up |", "|---|---|---|---|"]
    for n, row in times.items():
        c, k = statistics.median(row["compiled op"]), statistics.median(row["kernel"])
        lines.append(f"| {n:,} tokens | {c:.3f} ({min(row['compiled op']):.3f}-{max(row['compiled op']):.3f}) | "
                     f"{k:.3f} ({min(row['kernel']):.3f}-{max(row['kernel']):.3f}) | {c / k:.2f}x |")
    lines += ["", f"20,000-token prompt: same greedy token {same_token}; last logits' relative difference {rel:.2f} "
              "(rounding, amplified by the random deep net)."]
    md = "\n".join(lines) + "\n"
    write_results(args.out, "prefill_softmax_ab", results, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
