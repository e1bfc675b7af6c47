"""The GPU verify cost curve to 64 tokens: Gemma 4 E4B shape, int4, the fast path's step kernels.

Usage (GPU machine): python -m bench.gpu_cost_curve [--out DIR] [--rounds 20]
Writes DIR/gpu_cost_curve.json and DIR/gpu_cost_curve.md (default bench/results/).

Builds the model as bench/gpu_e4b.py does (random init from the E4B config, quanto int4, lm_head
bf16) and the FastTarget as the server's engine does (per-layer embeddings on the host, the default
buckets 2..64, min_kv_len 1024, an 8k context), then measures:

- warm-up: seconds and CUDA graphs of `FastTarget.warmup()` (every (bucket, kv_len) graph), per
  bucket, and GPU memory before and after (the graphs' pool included);
- the verify cost curve: median seconds of an n-token step, n = 1, 2, 4, 8, 16, 32, 64 (and the
  rows between that pad to a bucket), at 1k and 8k context, through `server.backend.time_forwards`
  (the server's own measurement: interleaved rounds, device-to-host copy included);
- batch invariance at full depth: a 64-token step's logits equal 64 one-token steps' bit for bit;
- token trees: a 64-row tree step's rows equal a chain step's for one root path bit for bit, the
  tree step's time and what `keep_path` of that path costs.
Random weights: timings are real, acceptance is not.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.gpu_e4b import build_model
from server.backend import time_forwards
from server.fast_path import DEFAULT_BUCKETS, FastTarget

POINTS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_cost_curve", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    import transformers

    r: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__, "buckets": list(DEFAULT_BUCKETS), "rounds": args.rounds}
    model = build_model(quant=True)
    model.model.embed_tokens_per_layer.to("cpu")  # as the engine: the per-layer table lives on the host
    torch.cuda.empty_cache()
    r["mem_model_GiB"] = torch.cuda.memory_allocated() / GIB
    context = 8192
    t = time.perf_counter()
    fast = FastTarget(model, max_len=context + DEFAULT_BUCKETS[-1], buckets=DEFAULT_BUCKETS, min_kv_len=1024,
                      ple_on_host=True)
    torch.cuda.synchronize()
    r["build_s"] = time.perf_counter() - t
    r["mem_built_GiB"] = torch.cuda.memory_allocated() / GIB
    r["step_scratch_MiB"] = getattr(fast, "step_scratch_bytes", 0) / 2**20
    r["attention_scratch_MiB"] = sum(a.m.numel() * 4 + a.l.numel() * 4 + a.acc.numel() * 4
                                     for a in fast.step_attention.values()) / 2**20
    r["step_kernel_note"] = fast.step_kernel_note
    r["warmup_s"] = fast.warmup()
    torch.cuda.synchronize()
    r["graphs"] = fast.timings.graphs
    r["mem_warm_GiB"] = torch.cuda.memory_allocated() / GIB
    r["mem_warm_reserved_GiB"] = torch.cuda.memory_reserved() / GIB
    per = {}
    for (T, kv), s in fast.timings.extra["capture_s"].items():
        per.setdefault(T, []).append(s)
    r["capture_s_by_bucket"] = {T: sum(v) for T, v in sorted(per.items())}
    r["kv_lens"] = sorted({kv for _, kv in fast.timings.extra["capture_s"]})
    print(json.dumps(r, indent=1), flush=True)

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = {"1k": torch.randint(3, vocab, (1024,), generator=g).tolist(),
               "8k": torch.randint(3, vocab, (context,), generator=g).tolist()}
    r["curve_s"] = {}
    for name, prompt in prompts.items():
        r["curve_s"][name] = time_forwards(fast, prompt, list(POINTS), rounds=args.rounds)
        print(name, {n: round(s * 1e3, 2) for n, s in r["curve_s"][name].items()}, flush=True)

    # 64-token verify == 64 one-token steps, at full depth (teacher-forced on random ids)
    ids = prompts["1k"]
    fast.start(ids[:900], reuse=False)
    batched = fast.step(ids[900:964]).clone()
    fast.rollback(64)
    singles = torch.cat([fast.step([t]).clone() for t in ids[900:964]])
    r["verify64_equals_steps"] = bool(torch.equal(batched, singles))
    print("verify64 == steps:", r["verify64_equals_steps"], flush=True)

    # token trees: a 64-row tree's rows equal a chain step's (the deepest leaf's path), and costs
    import random
    import statistics
    rng = random.Random(0)
    parents = [-1] + [rng.randrange(max(0, j - 3), j) for j in range(1, 64)]
    path = [63]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    path = path[::-1]
    tokens = ids[900:964]
    fast.start(ids[:900], reuse=False)
    tree = fast.step(tokens, parents).clone()
    fast.rollback(64)
    r["tree64_equals_chain"] = bool(torch.equal(tree[path], fast.step([tokens[j] for j in path])))
    tree_s, keep_s = [], []
    for i in range(args.rounds + 1):
        fast.rollback(fast.position - 900)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fast.step(tokens, parents).argmax(-1).cpu()
        t1 = time.perf_counter()
        fast.keep_path(path)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i:
            tree_s.append(t1 - t0)
            keep_s.append(t2 - t1)
    r["tree64_step_ms"] = statistics.median(tree_s) * 1e3
    r["keep_path_ms"] = statistics.median(keep_s) * 1e3
    r["keep_path_len"] = len(path)
    print("tree", r["tree64_equals_chain"], r["tree64_step_ms"], "keep_path", r["keep_path_ms"], len(path), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_cost_curve.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
    (out / "gpu_cost_curve.md").write_text(markdown(r))
    print(markdown(r))
    return 0


ABOUT = """Steps take up to 64 tokens (buckets 2, 4, 8, 16, 32, 64). The step kernels keep their 16-row
tensor-core tile at every bucket: a 32- or 64-token step runs 2 or 4 row tiles against each weight
tile it reads once, so a row's arithmetic is the same instructions in the same order in every bucket
and drafted output stays bit-for-bit plain output (tests/test_step_kernel_rows.py,
tests/test_fast_path.py). The engine's cost model weighs a longer draft against this curve."""


def markdown(r: dict) -> str:
    c = r["curve_s"]
    pts = sorted(int(n) for n in next(iter(c.values())))
    lines = [
        "# GPU verify cost curve to 64 tokens (Gemma 4 E4B shape, int4, fast path)",
        "",
        ABOUT,
        "",
        f"{r['device']}, torch {r['torch']}, transformers {r['transformers']}. Random-init E4B text config, quanto "
        "int4 weights (group 128), lm_head bf16, per-layer embeddings on the host; steps on the batch-invariant "
        f"Triton step kernels, buckets {tuple(r['buckets'])} (1 runs as 2). Command: `python -m bench.gpu_cost_curve`.",
        "Median of " + str(r["rounds"]) + " interleaved rounds (`server.backend.time_forwards`: the server's own "
        "measurement, host sync included). Random weights: timings are real, acceptance is not.",
        "",
        "| context | " + " | ".join(f"n={n}" for n in pts) + " |",
        "|---|" + "---|" * len(pts),
    ]
    for name, curve in c.items():
        lines.append(f"| {name}, ms | " + " | ".join(f"{curve[n] * 1e3:.2f}" for n in pts) + " |")
        lines.append(f"| {name}, / n=1 | " + " | ".join(f"{curve[n] / curve[1]:.2f}x" for n in pts) + " |")
    by = ", ".join(f"{T}: {s:.1f} s" for T, s in r["capture_s_by_bucket"].items())
    lines += [
        "",
        f"Warm-up (`FastTarget.warmup()`, every (bucket, kv_len) graph; kv_len {r['kv_lens']}): {r['graphs']} CUDA "
        f"graphs in {r['warmup_s']:.1f} s (the first graph includes torch.compile of the fused elementwise ops); "
        f"capture seconds by bucket: {by}.",
        f"GPU memory: model {r['mem_model_GiB']:.2f} GiB; after building the fast path {r['mem_built_GiB']:.2f} GiB "
        f"(step kernels' int4 copy, dense prefill copy, static KV; shared split-K scratch "
        f"{r['step_scratch_MiB']:.0f} MiB, attention scratch {r['attention_scratch_MiB']:.0f} MiB); after warm-up "
        f"{r['mem_warm_GiB']:.2f} GiB allocated, {r['mem_warm_reserved_GiB']:.2f} GiB reserved.",
        f"A 64-token step's logits equal 64 one-token steps' bit for bit (full depth, 900-token context): "
        f"{r['verify64_equals_steps']}.",
    ]
    if "keep_path_ms" in r:
        lines.append(f"Token tree of 64 rows (900-token context): each row's logits equal the chain step of its root path "
                     f"bit for bit: {r['tree64_equals_chain']}; the tree step {r['tree64_step_ms']:.2f} ms (a 64-token "
                     f"chain: {c['1k'][64] * 1e3:.2f} ms at 1k); `keep_path` of a {r['keep_path_len']}-row path "
                     f"{r['keep_path_ms']:.2f} ms (K/V moved in every layer that owns a cache, device sync included).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
