"""GPU memory of the fast path with one int4 layout: Gemma 4 E4B shape, int4, 8k and 32k contexts.

Usage (GPU machine): python -m bench.gpu_memory [--out DIR] [--cap-gib 5] [--contexts 8192,32768]
                                              [--allocator expandable|default] [--buckets engine|all]
                                              [--lm-head auto|bf16|int8|bf16,auto]
Writes DIR/gpu_memory.json and DIR/gpu_memory.md (default bench/results/); `--allocator default`
(PyTorch's fixed segments, the A/B against the server's expandable segments: server.cuda_allocator)
adds `-default-allocator` to the names and `--buckets all` adds `-all-buckets`. `--lm-head`: the
LM head as the engine picks it under the cap (auto: int8, server.fast_memory.plan_fast_memory), or
as asked; a list runs every context with each, in order (bf16 first: the int8 head moves the bf16
table to the host for good), side by side in one table.

Builds the model as bench/gpu_e4b.py does (random init from the E4B config, quanto int4, lm_head =
tied bf16 embedding, the per-layer table on the host) and, for each context, the FastTarget the
engine builds under `--gpu-memory-mb` (plan_fast_memory with the cap: prefill in pieces of its
prefill_rows, no dense prefill copy; the engine's step buckets for the default draft cap, 2..32, or
with `--buckets all` every one to 64; min_kv_len 1024), then records GPU
memory after loading, after building (quanto's tensors released), after warm-up (every CUDA graph),
the start-up peak (building and warm-up), and the serving PEAK while prefilling a prompt of that
length and decoding 64 tokens:
torch.cuda.max_memory_allocated / max_memory_reserved, and the device's used memory
(cudaMemGetInfo, polled every 2 ms from a thread, which is what nvidia-smi shows: the CUDA context
included). Also: the KV cache, the graphs' pool, the scratch buffers, what the planner said;
plain decode tokens/s at 1k; prefill tokens/s of the old paths (tinygemm on quanto's tensors, which
run first while they exist; the per-call compiled dequantization; the dense bf16 copy) against the
new one (Triton dequantization into one shared scratch, then cuBLAS); the logits' max abs
difference between them; drafted == plain (oracle drafts with errors) on the new path.
Random weights: timings and memory are real, acceptance is not.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench.fast_greedy import greedy_generate, oracle
from bench.gpu_e4b import build_model, timed_generate
from ngram.drafter import DrafterConfig
from server.fast_memory import outside_memory, plan_fast_memory
from server.fast_path import DEFAULT_BUCKETS, FastTarget, step_buckets
from server.fast_prefill import score_budget

GIB = 2**30
GEN = 64


class UsedMemory:
    """The device's used memory (total - free), its maximum polled from a thread."""

    def __init__(self, period: float = 0.002):
        self.period, self.peak, self._stop, self._lock = period, 0, threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _run(self):
        while not self._stop.is_set():
            with self._lock:  # so that a reset between the read and the write is not undone
                self.peak = max(self.peak, self.now())
            time.sleep(self.period)

    def reset(self):
        with self._lock:
            self.peak = self.now()

    def stop(self):
        self._stop.set()
        self._thread.join()


def smi_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(out.split()[0])
    except Exception:
        return None


def mem(used: UsedMemory) -> dict:
    torch.cuda.synchronize()
    return {"allocated_GiB": torch.cuda.memory_allocated() / GIB, "reserved_GiB": torch.cuda.memory_reserved() / GIB,
            "device_used_GiB": used.now() / GIB}


def timed_prefill(fast, prompt, reps: int = 2) -> tuple[float, torch.Tensor]:
    """Best seconds of `reps` prefills (the first also warms up), and the last token's logits."""
    best, logits = float("inf"), None
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = fast.prefill(prompt)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best, logits.float().clone()


def max_abs(a, b) -> float:
    return float((a - b).abs().max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--cap-gib", type=float, default=5.0)
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--allocator", choices=("expandable", "default"), default="expandable",
                    help="the CUDA caching allocator: expandable segments, as the server sets them "
                         "(server.cuda_allocator), or PyTorch's default fixed segments (the A/B)")
    ap.add_argument("--lm-head", default="auto",
                    help="auto, bf16 or int8 (server.fast_memory.plan_fast_memory's lm_head), or a list: bf16,auto")
    ap.add_argument("--buckets", choices=("engine", "all"), default="engine",
                    help="step buckets: the engine's for the default draft cap (server.fast_path.step_buckets), "
                         "or every one up to 64 rows (as before)")
    args = ap.parse_args(argv)
    heads = args.lm_head.split(",")
    first_int8 = next((i for i, h in enumerate(heads) if h != "bf16"), len(heads))
    if any(h not in ("auto", "bf16", "int8") for h in heads) or "bf16" in heads[first_int8:]:
        ap.error("--lm-head: auto, bf16 or int8, every bf16 before the others (the int8 head is for good)")
    import transformers

    from server.cuda_allocator import EXPANDABLE, configure_cuda_allocator

    allocator = configure_cuda_allocator(setting=EXPANDABLE if args.allocator == "expandable" else "")

    contexts = [int(c) for c in args.contexts.split(",")]
    cap = int(args.cap_gib * GIB)
    r: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__, "cap_GiB": args.cap_gib, "gen": GEN,
               "allocator": allocator or "PyTorch's default (fixed segments)"}
    used = UsedMemory()
    model = build_model(quant=True)
    model.model.embed_tokens_per_layer.to("cpu")  # as the engine: the per-layer table lives on the host
    torch.cuda.empty_cache()
    r["after_load"] = mem(used) | {"nvidia_smi_MiB": smi_used_mib()}
    print("after load", r["after_load"], flush=True)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    longest = max(contexts)
    tokens = torch.randint(3, vocab, (longest,), generator=g).tolist()
    prompts = {c: tokens[:c - GEN - 1] for c in contexts}

    # The old prefill path first, while quanto's tensors exist: tinygemm (no step kernels; fused q|k|v, gate|up).
    old = FastTarget(model, max_len=longest + DEFAULT_BUCKETS[-1], capture=False, step_kernels=False,
                     ple_on_host=True, release_weights=False)
    r["prefill_tps"] = {"tinygemm": {}}
    ref_logits = {}
    for c, p in prompts.items():
        s, ref_logits[c] = timed_prefill(old, p)
        r["prefill_tps"]["tinygemm"][c] = len(p) / s
    print("tinygemm prefill tok/s", r["prefill_tps"]["tinygemm"], flush=True)
    del old
    gc.collect()
    torch.cuda.empty_cache()

    # the engine's buckets for its default draft cap (server.engine: step_buckets), or all of them
    buckets = step_buckets(DrafterConfig.max_draft) if args.buckets == "engine" else DEFAULT_BUCKETS
    r["buckets"] = list(buckets)
    r["runs"] = {}
    fast = None
    for head, c in [(head, c) for head in heads for c in contexts]:
        label = str(c) if len(heads) == 1 else f"{c}, {head} head"
        del fast
        fast = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        used.reset()
        run: dict = {"before": mem(used), "context": c}
        run["outside_at_plan_GiB"] = outside_memory(torch.device("cuda")) / GIB  # CUDA context, libraries
        plan = plan_fast_memory(model, c, c, 0, gpu_memory=cap, buckets=buckets, lm_head=head)
        run["plan"] = {"context": plan.context, "prefill_rows": plan.prefill_rows, "dense": plan.prefill_dense,
                       "reserve_GiB": plan.reserve / GIB, "per_pos_KiB": plan.per_pos / 1024, "note": plan.note,
                       "lm_head": "int8" if plan.lm_head_int8 else "bf16"}
        t = time.perf_counter()
        # the context the plan serves, as the engine builds it (less than asked when it does not fit)
        fast = FastTarget(model, max_len=plan.context + buckets[-1], buckets=buckets, min_kv_len=1024,
                          ple_on_host=True, prefill_dense=False, prefill_rows=plan.prefill_rows,
                          lm_head_int8=plan.lm_head_int8)
        torch.cuda.synchronize()
        run["build_s"] = time.perf_counter() - t
        run["built"] = mem(used) | {"max_allocated_GiB": torch.cuda.max_memory_allocated() / GIB}
        run["released_GiB"] = fast.released_bytes / GIB
        run["kv_cache_GiB"] = fast.cache_bytes() / GIB
        run["lm_head_GiB"] = fast.lm_head_step.nbytes() / GIB
        run["step_linears_GiB"] = sum(lin.nbytes() for lin in fast.step_linears() if lin.int4) / GIB
        run["dense_copy_GiB"] = sum(lin.n * lin.k * 2 for lin in fast.step_linears() if lin.int4) / GIB
        run["prefill_scratch_MiB"] = fast.prefill_scratch_bytes / 2**20
        run["split_k_scratch_MiB"] = fast.step_scratch_bytes / 2**20
        run["attention_scratch_MiB"] = sum((a.m.numel() + a.l.numel() + a.acc.numel()) * 4
                                           for a in fast.step_attention.values()) / 2**20
        run["rope_MiB"] = fast.rope_table.numel() * fast.rope_table.element_size() / 2**20
        run["prefill_note"] = fast.prefill_note
        run["warmup_s"] = fast.warmup()
        run["graphs"] = fast.timings.graphs
        run["warm"] = mem(used) | {"nvidia_smi_MiB": smi_used_mib()}
        run["outside_warm_GiB"] = outside_memory(torch.device("cuda")) / GIB
        # the start-up peak (building, then capturing every graph), apart from the serving peak below
        run["startup_peak"] = {"max_allocated_GiB": torch.cuda.max_memory_allocated() / GIB,
                               "max_reserved_GiB": torch.cuda.max_memory_reserved() / GIB,
                               "device_used_GiB": used.peak / GIB}
        run["graph_pool_MiB"] = (run["warm"]["allocated_GiB"] - run["built"]["allocated_GiB"]) * 1024
        print(label, json.dumps(run, indent=0, default=str), flush=True)
        p = prompts[c][:plan.context - GEN - 1]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        used.reset()
        t = time.perf_counter()
        logits = fast.prefill(p)
        torch.cuda.synchronize()
        run["prefill_s"] = time.perf_counter() - t
        run["prefill_tps_first"] = len(p) / run["prefill_s"]
        out = [int(logits.argmax())]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(GEN - 1):
            out.append(int(fast.step([out[-1]])[0].argmax()))
        torch.cuda.synchronize()
        run["decode_tps_at_context"] = (GEN - 1) / (time.perf_counter() - t)
        run["peak"] = {"max_allocated_GiB": torch.cuda.max_memory_allocated() / GIB,
                       "max_reserved_GiB": torch.cuda.max_memory_reserved() / GIB,
                       "device_used_GiB": used.peak / GIB, "nvidia_smi_MiB_after": smi_used_mib()}
        run["prefill_transient_GiB"] = run["peak"]["max_allocated_GiB"] - run["warm"]["allocated_GiB"]
        s, new_logits = timed_prefill(fast, p)
        run["prefill_tps"] = len(p) / s
        if len(p) == len(prompts[c]):  # the reference's prompt (not when the plan cut the context)
            run["logits_max_abs_diff_vs_tinygemm"] = max_abs(new_logits, ref_logits[c])
            run["logits_argmax_same_as_tinygemm"] = bool(new_logits.argmax() == ref_logits[c].argmax())
        print(label, "peak", run["peak"], "prefill tok/s", run["prefill_tps"], flush=True)
        r["runs"][label] = run

    # The last FastTarget (longest context): the same prefill through other paths, speed and logits.
    c = longest
    p = prompts[c][:fast.max_context - GEN - 1]
    base_s, base = timed_prefill(fast, p)
    cmp: dict = {"context": c, "prompt": len(p), "prefill_rows": fast.prefill_rows, "new_tps": len(p) / base_s}
    rows, budget = fast.prefill_rows, fast.score_budget
    fast.prefill_rows, fast.score_budget = 8192, score_budget(8192)
    s, big = timed_prefill(fast, p)
    cmp["new_8192_rows_tps"] = len(p) / s
    cmp["max_abs_diff_8192_vs_%d_rows" % rows] = max_abs(big, base)
    lins = [lin for lin in fast.step_linears() if getattr(lin, "int4", False)]
    scratch = [lin.prefill_scratch for lin in lins]
    for lin in lins:
        lin.prefill_scratch = None  # the earlier path: torch.compile'd dequantization to a new W^T per call
    s, compiled = timed_prefill(fast, p)
    cmp["compiled_dequant_8192_rows_tps"] = len(p) / s
    cmp["max_abs_diff_compiled_vs_new"] = max_abs(compiled, big)
    for lin, sc in zip(lins, scratch):
        lin.prefill_scratch = sc
    from server.fast_prefill import keep_dense_weights
    keep_dense_weights(fast, True)
    s, dense = timed_prefill(fast, p)
    cmp["dense_copy_8192_rows_tps"] = len(p) / s
    cmp["max_abs_diff_dense_vs_new"] = max_abs(dense, big)
    for lin in lins:
        del lin.prefill_weight
    fast.prefill_rows, fast.score_budget = rows, budget
    torch.cuda.empty_cache()
    cmp["tinygemm_tps"] = r["prefill_tps"]["tinygemm"][c]
    cmp["max_abs_diff_vs_tinygemm"] = max_abs(base, ref_logits[c]) if len(p) == len(prompts[c]) else float("nan")
    cmp["logit_range"] = [float(base.min()), float(base.max())]
    # prefill vs the step kernels for the last token
    fast.prefill(p[:-1])
    step_last = fast.step(p[-1:])[0].float()
    cmp["max_abs_diff_prefill_vs_step"] = max_abs(base, step_last)
    r["prefill_compare"] = cmp
    print("prefill compare", cmp, flush=True)

    # plain decode at 1k, and drafted == plain, on the new path
    p1k = tokens[:1024]
    plain, steps, secs = timed_generate(fast, p1k, 128)
    r["decode_1k"] = {"tokens": 128, "plain_tps": 128 / secs}
    drafted, dsteps = greedy_generate(fast, p1k, 128, oracle(plain, len(p1k), vocab=vocab))
    r["decode_1k"]["drafted_equals_plain"] = drafted == plain
    r["decode_1k"]["drafted_steps"], r["decode_1k"]["plain_steps"] = dsteps, steps
    print("decode 1k", r["decode_1k"], flush=True)
    used.stop()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r["command"] = "python -m bench.gpu_memory" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    name = "gpu_memory" + ("" if args.allocator == "expandable" else "-default-allocator") + \
        ("" if args.buckets == "engine" else "-all-buckets") + ("" if heads == ["auto"] else "-head-" + "-".join(heads))
    (out / f"{name}.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown(r))
    print(markdown(r))
    return 0


def markdown(r: dict) -> str:
    runs = r["runs"]
    ctx = list(runs)
    f = lambda v: f"{v:.2f}"
    row = lambda name, get: f"| {name} | " + " | ".join(get(runs[c]) for c in ctx) + " |"
    lines = [
        "# GPU memory of the fast path, one int4 layout (Gemma 4 E4B shape, int4)",
        "",
        f"{r['device']}, torch {r['torch']}, transformers {r['transformers']}. Random-init E4B text config, quanto "
        "int4 weights (group 128), lm_head = tied embedding, per-layer embeddings on the host. The FastTarget "
        f"the engine builds under `--gpu-memory-mb {int(r['cap_GiB'] * 1024)}` (the LM head as the planner picks it: "
        "auto is int8 under a cap, a scale per 128 features, the bf16 table then on the host): steps on the step kernels, prefill "
        "through the same int4 layout (each linear dequantized into one shared scratch, then cuBLAS), quanto's "
        f"tensors released, no dense prefill copy; step buckets {r.get('buckets', '2..64')}. CUDA allocator: {r.get('allocator', 'default')}. "
        f"Command: `{r.get('command', 'python -m bench.gpu_memory')}`.",
        "Serving peak: while prefilling a prompt of the context's length (less the 65 decoded positions) and decoding "
        f"{r['gen']} tokens; 'device used' is total - free memory (what nvidia-smi shows, the CUDA context and "
        "other libraries' memory included), polled every 2 ms. Start-up peak: while building the fast path and "
        "capturing its graphs, before the first request.",
        "",
        "| GiB | " + " | ".join(f"{c} context" for c in ctx) + " |",
        "|---|" + "---|" * len(ctx),
        "| after load (quanto int4 + bf16 embedding), allocated | " + " | ".join(
            f(r["after_load"]["allocated_GiB"]) for _ in ctx) + " |",
        row("LM head (as planned), its GiB on the GPU", lambda x: f"{x['plan'].get('lm_head', 'bf16')} {x.get('lm_head_GiB', 0):.2f}"),
        row("after building the fast path, allocated", lambda x: f(x["built"]["allocated_GiB"])),
        row("after warm-up (all graphs), allocated", lambda x: f(x["warm"]["allocated_GiB"])),
        row("after warm-up, reserved", lambda x: f(x["warm"]["reserved_GiB"])),
        row("after warm-up, device used", lambda x: f(x["warm"]["device_used_GiB"])),
        row("**serving peak allocated** (prefill + 64 steps)", lambda x: f"**{x['peak']['max_allocated_GiB']:.2f}**"),
        row("**serving peak reserved**", lambda x: f"**{x['peak']['max_reserved_GiB']:.2f}**"),
        row("**serving peak device used**", lambda x: f"**{x['peak']['device_used_GiB']:.2f}**"),
        row("start-up peak allocated (building, warm-up)", lambda x: f(x["startup_peak"]["max_allocated_GiB"])),
        row("start-up peak reserved", lambda x: f(x["startup_peak"]["max_reserved_GiB"])),
        row("start-up peak device used", lambda x: f(x["startup_peak"]["device_used_GiB"])),
        row("prefill's transient (peak - warm, allocated)", lambda x: f(x["prefill_transient_GiB"])),
        row("static KV cache", lambda x: f(x["kv_cache_GiB"])),
        row("step-kernel int4 layout (all int4 weights, once)", lambda x: f(x["step_linears_GiB"])),
        row("quanto tensors released at build", lambda x: f(x["released_GiB"])),
        row("graph pool (warm - built)", lambda x: f(x["graph_pool_MiB"] / 1024)),
        row("step attention scratch", lambda x: f(x["attention_scratch_MiB"] / 1024)),
        row("prefill dequantization scratch", lambda x: f(x["prefill_scratch_MiB"] / 1024)),
        row("split-K scratch", lambda x: f(x["split_k_scratch_MiB"] / 1024)),
        row("RoPE tables", lambda x: f(x["rope_MiB"] / 1024)),
        row("CUDA context and libraries (device used - reserved), at planning / after warm-up",
            lambda x: f"{x.get('outside_at_plan_GiB', 0):.2f} / {x.get('outside_warm_GiB', 0):.2f}"),
        row("planner: context under the cap", lambda x: str(x["plan"]["context"])),
        row("planner: prefill piece (tokens)", lambda x: str(x["plan"]["prefill_rows"])),
        row("CUDA graphs (warm-up s)", lambda x: f"{x['graphs']} ({x['warmup_s']:.1f} s)"),
        row("prefill tokens/s (new path)", lambda x: f"{x['prefill_tps']:.0f}"),
        "| prefill tokens/s (tinygemm on quanto's tensors, before) | " + " | ".join(
            f"{r['prefill_tps']['tinygemm'][runs[c].get('context', c)]:.0f}" for c in ctx) + " |",
        row("plain decode tokens/s at this context", lambda x: f"{x['decode_tps_at_context']:.1f}"),
        row("prefill logits max abs diff vs tinygemm",
            lambda x: f"{x['logits_max_abs_diff_vs_tinygemm']:.3f}" if "logits_max_abs_diff_vs_tinygemm" in x else "-"),
    ]
    cmp = r["prefill_compare"]
    rows = cmp["prefill_rows"]
    d = r["decode_1k"]
    lines += [
        "",
        f"Prefill paths on the {cmp['prompt']}-token prompt (tokens/s; logits of the last token, max abs difference; "
        f"logits span {cmp['logit_range'][0]:.1f}..{cmp['logit_range'][1]:.1f}):",
        "",
        "| path | tokens/s | max abs diff |",
        "|---|---|---|",
        f"| tinygemm on quanto's int4 (before) | {cmp['tinygemm_tps']:.0f} | {cmp['max_abs_diff_vs_tinygemm']:.3f} vs new |",
        f"| new: dequantize into shared scratch + cuBLAS, pieces of {rows} | {cmp['new_tps']:.0f} | |",
        f"| new, pieces of 8192 | {cmp['new_8192_rows_tps']:.0f} | "
        f"{cmp['max_abs_diff_8192_vs_%d_rows' % rows]:.3f} vs {rows} |",
        f"| earlier: torch.compile'd dequantization to a new W^T per call, 8192 | "
        f"{cmp['compiled_dequant_8192_rows_tps']:.0f} | {cmp['max_abs_diff_compiled_vs_new']:.3f} vs new 8192 |",
        f"| dense bf16 copy kept (+{r['runs'][ctx[-1]]['dense_copy_GiB']:.1f} GiB), 8192 | "
        f"{cmp['dense_copy_8192_rows_tps']:.0f} | {cmp['max_abs_diff_dense_vs_new']:.3f} vs new 8192 |",
        "",
        f"Prefill's last-token logits vs the step kernels' for the same token: max abs diff "
        f"{cmp['max_abs_diff_prefill_vs_step']:.3f}.",
        f"Plain decode at 1k context: {d['plain_tps']:.1f} tokens/s ({d['tokens']} tokens); drafted (oracle drafts, "
        f"20% wrong tokens) equals plain: {d['drafted_equals_plain']} ({d['drafted_steps']} vs {d['plain_steps']} steps).",
        "",
        "Planner notes: " + " / ".join(f"{c}: {runs[c]['plan']['note']}" for c in ctx),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
