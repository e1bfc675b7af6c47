"""The CPU int8 path against llama.cpp on the bundled GGUF, side by side, one run.

    python -m bench.cpu_path [--requests 6] [--max-tokens 64] [--threads 2] [--quick] [--llama-server PATH]

Same prompts (bench.workloads' tool-call and agentic requests, the bench index built as `make bench`
builds it), same thread count, greedy, one process; contenders run request by request in turn, so
machine noise spreads over all of them:
- `eager plain`: Sailfish on transformers' fp32 forward (`--no-cpu-int8`);
- `int8 plain` / `int8 drafted`: Sailfish's CPU int8 path (`--cpu-int8`, server/cpu_model.py), plain
  and with the n-gram drafter; `int8 drafted, trees`: the drafter with token trees (`--tree`);
- `llama.cpp plain` / `llama.cpp prompt lookup`: llama-cpp-python on the same GGUF, plain and with its
  prompt-lookup draft model (LlamaPromptLookupDecoding, 10 tokens);
- with `--llama-server PATH` (a llama-server binary of the same llama.cpp): `llama-server plain`,
  `llama-server ngram-simple` (n 4, m 16) and `llama-server ngram-mod` (its `--spec-default`),
  llama.cpp's own n-gram speculative modes, which llama-cpp-python lacks (their decode and prefill
  tokens/s are the server's own timings).
Decode tokens/s = (tokens - 1) / (time of the last token - time of the first); prefill tokens/s =
prompt tokens / time to the first token, on the same prompts. `identical` compares each engine's
drafted output with its own plain output. Output: bench/results/cpu_path.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.results import write_results


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_path", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="2 requests per workload, 32 tokens")
    p.add_argument("--llama-server", help="a llama-server binary: adds llama.cpp's own server, plain and with its "
                                           "n-gram modes (ngram-simple n 4 m 16, ngram-mod)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens = 2, 32
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from bench.__main__ import build_bench_index, prompt_ids
    from bench.contenders import LlamaCpp, run_engine
    from bench.workloads import WORKLOADS
    from common.bundled_model import bundled_gguf_path
    from common.chat_format import ChatFormat
    from ngram.drafter import DrafterConfig, NgramDrafter
    from server import cpu_kernels
    from server.engine import Engine, EngineConfig
    from server.model_loading import load_target

    cpu_kernels.set_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        index, _ = build_bench_index(Path(tmp))
        target = load_target(None)
        tok = target.tokenizer
        fmt = ChatFormat.for_tokenizer(tok)
        stop_ids = frozenset(fmt.stop_token_ids(tok))
        drafter = NgramDrafter(index)
        tree_drafter = NgramDrafter(index, DrafterConfig(tree=True))
        eager = Engine(target, None, EngineConfig(cpu_int8=False, cost_cache=None))
        int8 = Engine(target, None, EngineConfig(cpu_int8=True, cost_cache=None))
        llama = LlamaCpp(str(bundled_gguf_path()), threads=args.threads)
        servers = {}
        if args.llama_server:
            from bench.contenders import LlamaServer

            servers = {f"llama-server {mode}": LlamaServer(args.llama_server, str(bundled_gguf_path()), mode, args.threads)
                       for mode in LlamaServer.MODES}
        results = {"threads": args.threads, "requests": args.requests, "max_tokens": args.max_tokens,
                   "kernels": "C" if cpu_kernels.AVAILABLE else "numpy", "int8_notes": int8.notes,
                   "int8_cost_curve": [float(c) for c in int8.policy.cost[1:]], "workloads": {}}
        for name in ("tool_calls", "agentic"):
            rows = []
            for req in WORKLOADS[name](args.requests):
                prompt = prompt_ids(fmt, tok, req, args.max_prompt)
                row = {}
                for label, engine, draft in (("eager plain", eager, None), ("int8 plain", int8, None),
                                             ("int8 drafted", int8, drafter), ("int8 drafted, trees", int8, tree_drafter)):
                    engine.set_drafter(draft)
                    run = run_engine(engine, prompt, args.max_tokens, draft=draft is not None, prefix_cache=False)  # fresh prefills
                    row[label] = {"tok_s": run.decode_tok_s, "tokens": run.tokens,
                                  "prefill_tok_s": len(prompt) / run.stats["prefill_s"]}
                for label, lookup in (("llama.cpp plain", False), ("llama.cpp prompt lookup", True)):
                    run = llama.run(prompt, args.max_tokens, lookup, stop_ids)
                    row[label] = {"tok_s": run.decode_tok_s, "tokens": run.tokens}
                    if not lookup:
                        row[label]["prefill_tok_s"] = len(prompt) / max(run.first_token_s, 1e-9)
                for label, server in servers.items():
                    run, decode, prefill = server.run(prompt, args.max_tokens)
                    row[label] = {"tok_s": decode, "tokens": run.tokens, "prefill_tok_s": prefill}
                row["identical"] = {"int8": row["int8 drafted"]["tokens"] == row["int8 plain"]["tokens"],
                                    "int8 trees": row["int8 drafted, trees"]["tokens"] == row["int8 plain"]["tokens"],
                                    "llama.cpp": row["llama.cpp prompt lookup"]["tokens"] == row["llama.cpp plain"]["tokens"]}
                for label in servers:
                    if label != "llama-server plain":
                        row["identical"][label] = row[label]["tokens"] == row["llama-server plain"]["tokens"]
                rows.append(row)
                print(f"  {name} " + "  ".join(f"{k} {v['tok_s']:.1f}" for k, v in row.items() if k != "identical")
                      + f"  identical {row['identical']}", file=sys.stderr, flush=True)
            contenders = [k for k in rows[0] if k != "identical"]
            results["workloads"][name] = {
                "decode_tok_s": {k: _spread([r[k]["tok_s"] for r in rows]) for k in contenders},
                "prefill_tok_s": {k: _spread([r[k]["prefill_tok_s"] for r in rows]) for k in contenders
                                  if "prefill_tok_s" in rows[0][k]},
                "identical": {e: sum(r["identical"][e] for r in rows) for e in rows[0]["identical"]},
                "requests": len(rows)}
        for server in servers.values():
            server.close()
    results["seconds"] = time.perf_counter() - started
    md = markdown(results)
    write_results(args.out, "cpu_path" + ("-quick" if args.quick else ""), results, md)
    print(md)
    return 0


ABOUT = """On the CPU, Gemma 3 and Gemma 4 text models run on Sailfish's own forward (`--cpu-int8`, the default;
`--no-cpu-int8` for transformers' fp32): every weight as int8 with a scale per 32 inputs (Q8_0's
layout; the bundled GGUF's Q8_0 embedding / LM head comes back exactly, its Q4_K/Q5_0/Q6_K tensors
are re-quantized from their dequantized values), activations quantized the same way, exact int32 dot
products per block (AVX-512 VNNI, AVX-VNNI or AVX2, picked at run time; elsewhere, an ARM Mac
among them, portable C with the same bits, built and checked here as such a compiler sees it:
tests/test_portable_build.py, not timed), a static KV cache, and no
transformers in the loop. Each row's arithmetic is one fixed sequence whatever the rows beside it or
the thread count, so a verify's logits equal one-token steps' bit for bit and drafted output equals
plain output (tests/test_cpu_model.py, tests/test_cpu_kernels.py). llama.cpp's drafted output
differs from its own plain output on some requests (its batched kernels differ from its one-token ones).
`make bench` runs this without llama-server, which the pip package does not ship; build it from
llama-cpp-python's vendored llama.cpp and pass `--llama-server PATH`."""


def best_ngram_mode(w: dict) -> tuple[str, float] | None:
    """llama.cpp's fastest drafted mode on a workload (name, median tok/s), or None when none ran."""
    modes = {k: s["median"] for k, s in w["decode_tok_s"].items()
             if k.startswith(("llama-server ", "llama.cpp ")) and not k.endswith(" plain")}
    return max(modes.items(), key=lambda kv: kv[1]) if modes else None


def markdown(r: dict) -> str:
    lines = [ABOUT, "", f"{r['requests']} requests per workload, {r['max_tokens']} new tokens, greedy, {r['threads']} threads, "
             f"bundled Gemma 3 270M; the int8 path on its {r['kernels']} kernels. Run took {r['seconds'] / 60:.1f} min.", "",
             "| workload | contender | decode tok/s (median, min..max) | prefill tok/s | drafted = own plain |",
             "|---|---|---|---|---|"]
    for name, w in r["workloads"].items():
        for k, s in w["decode_tok_s"].items():
            pre = w["prefill_tok_s"].get(k)
            same = ""
            if k == "int8 drafted":
                same = f"{w['identical']['int8']}/{w['requests']}"
            elif k == "int8 drafted, trees":
                same = f"{w['identical']['int8 trees']}/{w['requests']}"
            elif k == "llama.cpp prompt lookup":
                same = f"{w['identical']['llama.cpp']}/{w['requests']}"
            elif k in w["identical"]:
                same = f"{w['identical'][k]}/{w['requests']}"
            lines.append(f"| {name} | {k} | {s['median']:.1f} ({s['min']:.1f}..{s['max']:.1f}) | "
                         f"{pre['median']:.0f} | {same} |" if pre else
                         f"| {name} | {k} | {s['median']:.1f} ({s['min']:.1f}..{s['max']:.1f}) | - | {same} |")
    lines += ["", "int8 verify cost curve (forward time for n new tokens / 1): "
              + " ".join(f"{i + 1}:{c:.2f}" for i, c in enumerate(r["int8_cost_curve"])), ""]
    for name, w in r["workloads"].items():
        best, ours = best_ngram_mode(w), w["decode_tok_s"].get("int8 drafted")
        if best and ours:
            lines.append(f"- {name}: Sailfish drafted {ours['median']:.1f} tokens/s is {ours['median'] / best[1]:.2f}x "
                         f"llama.cpp's best n-gram mode here ({best[0]}, {best[1]:.1f}).")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
