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
- batch invariance at full depth: a 64-token step's logits equal 64 one-token steps' bit for bit
  (at 1k and 8k context);
- token trees of 16, 32 and 64 rows in three shapes (`tree_shape`), at 1k and 8k context: every
  leaf's root path gives its chain step's logits bit for bit, the tree step's time next to a chain
  step of as many rows, and what `keep_path` costs (the main chain, and the deepest path off it).
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
TREE_SIZES = (16, 32, 64)
TREE_SHAPES = ("main+branches", "main+leaves", "random")
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

    # 64-token verify == 64 one-token steps, at full depth (teacher-forced on random ids), at 1k and 8k
    r["verify64_equals_steps"] = {}
    for name, base in (("1k", 900), ("8k", 8100)):
        ids = prompts[name]
        fast.start(ids[:base], reuse=False)
        batched = fast.step(ids[base:base + 64]).clone()
        fast.rollback(64)
        singles = torch.cat([fast.step([t]).clone() for t in ids[base:base + 64]])
        r["verify64_equals_steps"][name] = bool(torch.equal(batched, singles))
    print("verify64 == steps:", r["verify64_equals_steps"], flush=True)

    r.update(trees(fast, prompts, args.rounds))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_cost_curve.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
    (out / "gpu_cost_curve.md").write_text(markdown(r))
    print(markdown(r))
    return 0


def tree_shape(kind: str, n: int, seed: int = 0) -> list[int]:
    """parents of an n-row tree, laid out as ngram.draft's trees are (main chain first):
    `main+branches`: a main chain of n/2 rows, then branches of 3 rows off its nodes in turn;
    `main+leaves`: a main chain of n/4 rows, then one-row branches off its nodes in turn (wide);
    `random`: each row's parent one of the 3 rows before it (deep and bushy)."""
    import random
    if kind == "random":
        rng = random.Random(seed + n)
        return [-1] + [rng.randrange(max(0, j - 3), j) for j in range(1, n)]
    main, branch = (n // 2, 3) if kind == "main+branches" else (n // 4, 1)
    parents = [-1] + list(range(main - 1))
    at = 0
    while len(parents) < n:
        parents.append(at)
        for _ in range(branch - 1):
            if len(parents) < n:
                parents.append(len(parents) - 1)
        at = (at + 1) % (main - 1)
    return parents


def _paths(parents: list[int]) -> dict[int, list[int]]:
    """Each leaf's root path."""
    inner = set(parents[1:])
    out = {}
    for leaf in (j for j in range(len(parents)) if j not in inner):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out[leaf] = path[::-1]
    return out


def trees(fast, prompts: dict, rounds: int) -> dict:
    """Token-tree verification at each context: every leaf's path of every tree gives its chain
    step's logits bit for bit; a tree step's time next to a chain step of as many rows (interleaved
    rounds, each step ending in a device-to-host copy, as time_forwards); keep_path's time for the
    main chain (nothing moves) and for the deepest path off it (K/V moved in every cache-owning layer)."""
    import statistics
    out = {"tree_equals_chain": {}, "tree_ms": {}, "chain_ms": {}, "keep_path_ms": {}, "tree_shapes": {}}
    for name, ids in prompts.items():
        base = len(ids) - 64
        fast.start(ids[:base], reuse=False)
        tokens = ids[base - 64:base]
        cases = [(kind, n) for n in TREE_SIZES for kind in TREE_SHAPES]
        equal = True
        for kind, n in cases:
            parents = tree_shape(kind, n)
            fast.rollback(fast.position - base)
            tree = fast.step(tokens[:n], parents).clone()
            for path in _paths(parents).values():
                fast.rollback(fast.position - base)
                equal &= bool(torch.equal(tree[path], fast.step([tokens[j] for j in path])))
            out["tree_shapes"][f"{kind} {n}"] = {"leaves": len(_paths(parents)),
                                                 "depth": max(len(p) for p in _paths(parents).values())}
        out["tree_equals_chain"][name] = equal
        tree_s = {c: [] for c in cases}
        chain_s = {n: [] for n in TREE_SIZES}
        keep_s = {c: {"main": [], "branch": []} for c in cases}
        for i in range(rounds + 1):
            for kind, n in cases:
                parents = tree_shape(kind, n)
                paths = _paths(parents)
                main = max(paths.values(), key=lambda p: (p == list(range(len(p))), len(p)))
                branch = max((p for p in paths.values() if p != list(range(len(p)))), key=len)
                for which, path in (("main", main), ("branch", branch)):
                    fast.rollback(fast.position - base)
                    t0 = time.perf_counter()
                    fast.step(tokens[:n], parents).argmax(-1).cpu()
                    t1 = time.perf_counter()
                    fast.keep_path(path)
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    if i:
                        tree_s[(kind, n)].append(t1 - t0)
                        keep_s[(kind, n)][which].append(t2 - t1)
                if kind == TREE_SHAPES[0]:
                    fast.rollback(fast.position - base)
                    t0 = time.perf_counter()
                    fast.step(tokens[:n]).argmax(-1).cpu()
                    if i:
                        chain_s[n].append(time.perf_counter() - t0)
        fast.rollback(fast.position - base)
        fast.discard()
        out["tree_ms"][name] = {f"{k} {n}": statistics.median(v) * 1e3 for (k, n), v in tree_s.items()}
        out["chain_ms"][name] = {n: statistics.median(v) * 1e3 for n, v in chain_s.items()}
        out["keep_path_ms"][name] = {f"{k} {n}": {w: statistics.median(x) * 1e3 for w, x in v.items()}
                                     for (k, n), v in keep_s.items()}
        print(name, "trees == chains:", equal, out["tree_ms"][name], out["chain_ms"][name],
              out["keep_path_ms"][name], flush=True)
    return out


TREES = """A token tree of n rows costs what a chain of n rows costs: the rows go through the same
matmuls, and the step attention keeps a chain's position-aligned key chunks for every row, the
step's own keys gathered into them by depth (server/step_attention.py), so only the one or two
chunks the step wrote into are done one token at a time. Trees are laid out as ngram.draft's:
`main+branches` a main chain of n/2 rows and branches of 3 rows off its nodes; `main+leaves` a main
chain of n/4 rows and one-row branches; `random` each row's parent one of the 3 before it. Chain and
tree steps are timed in the same interleaved rounds (median; each ends in a device-to-host copy).
`keep_path` of the main chain moves nothing (only the position); of the deepest path off it, it
copies the path's K/V in every layer that owns a cache (a device sync included in the time; for
`random`, "main" is the longest leaf path of rows 0, 1, 2, .. if there is one, else the deepest)."""


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
    rel = {n: [curve[n] / curve[1] for curve in c.values()] for n in (16, 32, 64) if n in pts}
    lines += [
        "",
        "Relative to a one-token step: " + "; ".join(f"{n} tokens {min(v):.2f}-{max(v):.2f}x" for n, v in rel.items())
        + " (1k-8k context): past 16 rows the four 16-row products per weight tile are no longer hidden "
        "under the weights' bytes, so a draft longer than 16 pays only when it is likely to be accepted.",
        "",
        f"Warm-up (`FastTarget.warmup()`, every (bucket, kv_len) graph; kv_len {r['kv_lens']}): {r['graphs']} CUDA "
        f"graphs in {r['warmup_s']:.1f} s (the first graph includes torch.compile of the fused elementwise ops); "
        f"capture seconds by bucket: {by}.",
        f"GPU memory: model {r['mem_model_GiB']:.2f} GiB; after building the fast path {r['mem_built_GiB']:.2f} GiB "
        f"(step kernels' int4 copy, dense prefill copy, static KV; shared split-K scratch "
        f"{r['step_scratch_MiB']:.0f} MiB, attention scratch {r['attention_scratch_MiB']:.0f} MiB); after warm-up "
        f"{r['mem_warm_GiB']:.2f} GiB allocated, {r['mem_warm_reserved_GiB']:.2f} GiB reserved.",
        "A 64-token step's logits equal 64 one-token steps' bit for bit (full depth; 900- and 8100-token context): "
        + (", ".join(f"{c}: {v}" for c, v in r["verify64_equals_steps"].items())
           if isinstance(r["verify64_equals_steps"], dict) else f"{r['verify64_equals_steps']}") + ".",
    ]
    if "tree_ms" in r:
        ctxs = list(r["tree_ms"])
        lines += [
            "",
            "## Token trees (`step(ids, parents)`, `keep_path`)",
            "",
            TREES,
            "",
            "Every leaf's root path of every tree below gives, row for row, its chain step's logits bit for bit: "
            + ", ".join(f"{c}: {r['tree_equals_chain'][c]}" for c in ctxs) + ".",
            "",
            "| tree | leaves | depth | " + " | ".join(f"{c} tree ms | {c} chain ms | {c} tree / chain" for c in ctxs)
            + " | " + " | ".join(f"{c} keep_path main / branch ms" for c in ctxs) + " |",
            "|---|---|---|" + "---|---|---|" * len(ctxs) + "---|" * len(ctxs),
        ]
        for key, shape in r["tree_shapes"].items():
            n = int(key.split()[-1])
            cells = []
            for c in ctxs:
                tree, chain = r["tree_ms"][c][key], r["chain_ms"][c][n]
                cells += [f"{tree:.2f}", f"{chain:.2f}", f"{tree / chain:.3f}x"]
            keeps = [f"{r['keep_path_ms'][c][key]['main']:.2f} / {r['keep_path_ms'][c][key]['branch']:.2f}" for c in ctxs]
            lines.append(f"| {key} | {shape['leaves']} | {shape['depth']} | " + " | ".join(cells) + " | "
                         + " | ".join(keeps) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
