"""`make bench`: Sailfish against its peers, side by side, one run: `python -m bench [--quick|--full]`.

Same target (the bundled Gemma 3 270M on the CPU, on the engine's default backend: the int8 path),
same prompts, same machine, one process:
- workloads: bench.workloads (tool calls from BFCL v4, agentic coding sessions, reasoning prose);
- contenders: Sailfish plain (the baseline of every ratio), Sailfish drafted (trie index + live
  context + overlay), transformers `generate(prompt_lookup_num_tokens=10)`, SuffixDecoding
  (arctic-inference) driving Sailfish's verify loop, and llama.cpp (llama-cpp-python) plain and with
  its prompt-lookup draft model on the same GGUF (another engine: compare its speed-up over its own
  plain decoding, absolute tokens/s beside it). Requests run contender after contender, in turn, so
  machine noise spreads over all of them.
- offline replay (ngram.replay) of each workload's plain outputs for every drafter: tau, acceptance,
  draft latency;
- the matrix: max draft x minimum match x confidence cut-off, tau from replay and tokens/s projected
  from replay and the measured verify cost curve, on the realistic workloads, plus a repetitive
  control prompt (labelled) that shows how repetition inflates long drafts;
- long context: prefill and decode tokens/s at 1k and 8k prompt tokens (32k with --full);
- concurrency (not in --quick): 2 and 4 simultaneous streams against a live server: throughput, and
  outputs equal to the same requests sent alone.
The index used is built from traces disjoint from the prompts: the BFCL v4 index split (the prompts
come from the held-out split) and generated stdlib agent sessions over other modules than the
prompts' (see bench.workloads). Every figure comes from this run; the Markdown table and the PNG
charts are made from the JSON. Output: bench/results/bench.{json,md} and bench/results/*.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.contenders import LlamaCpp, run_engine, run_hf_prompt_lookup
from bench.results import write_results
from bench.workloads import WORKLOAD_VERSION, WORKLOADS, agentic_index_conversations

MODES = {
    "quick": dict(requests=1, max_tokens=32, contexts=[1024], streams=[], matrix="small", max_prompt=768),
    "default": dict(requests=4, max_tokens=64, contexts=[1024, 8192], streams=[2, 4], matrix="full", max_prompt=1024),
    "full": dict(requests=10, max_tokens=128, contexts=[1024, 8192, 32768], streams=[2, 4], matrix="full", max_prompt=1536),
}


def spread(values: list[float]) -> dict:
    v = [x for x in values if x == x]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v),
            "iqr": [float(np.percentile(v, 25)), float(np.percentile(v, 75))]}


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def build_bench_index(tmp: Path):
    from index.build import build_index
    from ngram.index_file import load_index

    traces = tmp / "traces"
    traces.mkdir()
    with open(traces / "stdlib-agent.jsonl", "w") as f:
        for conv in agentic_index_conversations():
            f.write(json.dumps({"messages": conv.messages, "tools": conv.tools}) + "\n")
    summary = build_index([traces], tmp / "index", include_bfcl=True, progress=False)
    return load_index(tmp / "index"), summary


def prompt_ids(fmt, tok, req: dict, max_prompt: int) -> list[int]:
    text = fmt.render_prompt(req["messages"], req["tools"])
    return tok(text, add_special_tokens=False)["input_ids"][-max_prompt:]


def run_workloads(cfg, engine, drafter, suffix, llama, fmt, tok, stop_ids) -> tuple[dict, dict]:
    results, turns = {}, {}
    for name, make in WORKLOADS.items():
        rows = []
        turns[name] = []
        for req in make(cfg["requests"]):
            prompt = prompt_ids(fmt, tok, req, cfg["max_prompt"])
            row = {"id": req["id"], "prompt_tokens": len(prompt)}
            plain = run_engine(engine, prompt, cfg["max_tokens"], draft=False)
            engine.set_drafter(drafter)
            ours = run_engine(engine, prompt, cfg["max_tokens"], draft=True)
            engine.set_drafter(suffix)
            sfx = run_engine(engine, prompt, cfg["max_tokens"], draft=True)
            engine.set_drafter(drafter)
            hf = run_hf_prompt_lookup(engine.model, prompt, cfg["max_tokens"], stop_ids)
            runs = {"sailfish_plain": plain, "sailfish_drafted": ours, "suffix_decoding": sfx, "hf_prompt_lookup": hf}
            if llama is not None:
                runs["llamacpp_plain"] = llama.run(prompt, cfg["max_tokens"], False, stop_ids)
                runs["llamacpp_prompt_lookup"] = llama.run(prompt, cfg["max_tokens"], True, stop_ids)
            for key, run in runs.items():
                row[key] = {"tok_s": run.decode_tok_s, "tokens": len(run.tokens), **run.stats}
            row["identical"] = {k: runs[k].tokens == plain.tokens for k in ("sailfish_drafted", "suffix_decoding", "hf_prompt_lookup")}
            if llama is not None:
                row["identical"]["llamacpp_prompt_lookup"] = runs["llamacpp_prompt_lookup"].tokens == runs["llamacpp_plain"].tokens
            row["loop_rate"] = loop_rate(prompt, plain.tokens)
            rows.append(row)
            turns[name].append((np.asarray(prompt), np.asarray(plain.tokens)))
            log(f"  {name} {req['id'][:40]:40s} plain {plain.decode_tok_s:6.2f} drafted {ours.decode_tok_s:6.2f} "
                f"suffix {sfx.decode_tok_s:6.2f} hf-pl {hf.decode_tok_s:6.2f} tok/s")
        results[name] = summarize(rows, llama is not None)
    return results, turns


SAMPLING_PRESETS = {
    "T0.7 top_p0.8 top_k20": dict(temperature=0.7, top_p=0.8, top_k=20),     # an agent-benchmark client's
    "T1.0 top_k64 top_p0.95": dict(temperature=1.0, top_k=64, top_p=0.95),   # Gemma's recommendation
}


def run_sampled(cfg, engine, drafter, fmt, tok) -> dict:
    """Drafted against plain decoding under each sampling preset, same seed per request, on the
    tool-call and agentic workloads: decode tokens/s, whether the outputs are identical, and the
    engine's step counts (the GPU projection reads them)."""
    from server.sampling import SamplingParams

    out = {}
    for preset, fields in SAMPLING_PRESETS.items():
        for name in ("tool_calls", "agentic"):
            rows = []
            for k, req in enumerate(WORKLOADS[name](cfg["requests"])):
                prompt = prompt_ids(fmt, tok, req, cfg["max_prompt"])
                sampling = SamplingParams(seed=1000 + k, **fields)
                engine.set_drafter(drafter)
                plain = run_engine(engine, prompt, cfg["max_tokens"], draft=False, sampling=sampling)
                drafted = run_engine(engine, prompt, cfg["max_tokens"], draft=True, sampling=sampling)
                rows.append({"plain_tok_s": plain.decode_tok_s, "drafted_tok_s": drafted.decode_tok_s,
                             "speedup": drafted.decode_tok_s / plain.decode_tok_s if plain.decode_tok_s else None,
                             "identical": drafted.tokens == plain.tokens, "tokens": len(drafted.tokens),
                             **drafted.stats})
                log(f"  sampled {preset} {name} {req['id'][:30]:30s} plain {plain.decode_tok_s:6.2f} "
                    f"drafted {drafted.decode_tok_s:6.2f} tok/s identical {rows[-1]['identical']}")
            steps = sum(r["verify_steps"] + r["plain_steps"] for r in rows)
            out.setdefault(preset, {})[name] = {
                "speedup": spread([r["speedup"] for r in rows if r["speedup"]]),
                "plain_tok_s": spread([r["plain_tok_s"] for r in rows]),
                "drafted_tok_s": spread([r["drafted_tok_s"] for r in rows]),
                "identical": all(r["identical"] for r in rows), "requests": len(rows),
                # as a replay would report them, for bench.project_gpu
                "tau": sum(r["tokens"] for r in rows) / max(steps, 1),
                "drafted_tokens": sum(r["drafted"] for r in rows), "verify_steps": steps,
                "acceptance_rate": sum(r["accepted"] for r in rows) / max(sum(r["drafted"] for r in rows), 1),
                "rows": rows}
    return out


def loop_rate(prompt: list[int], out: list[int], n: int = 6) -> float:
    """Share of output tokens that end an n-gram already seen earlier (prompt or output): how much
    of the output is copying or looping, which any n-gram drafter predicts."""
    seq = list(prompt) + list(out)
    seen = {tuple(seq[i - n : i]) for i in range(n, len(prompt) + 1)}
    hits = 0
    for i in range(len(prompt), len(seq)):
        gram = tuple(seq[i - n + 1 : i + 1])
        hits += gram in seen
        seen.add(gram)
    return hits / max(len(out), 1)


def summarize(rows: list[dict], with_llama: bool) -> dict:
    keys = ["sailfish_plain", "sailfish_drafted", "suffix_decoding", "hf_prompt_lookup"]
    if with_llama:
        keys += ["llamacpp_plain", "llamacpp_prompt_lookup"]
    out = {"requests": rows, "tok_s": {k: spread([r[k]["tok_s"] for r in rows]) for k in keys}}
    base = [r["sailfish_plain"]["tok_s"] for r in rows]
    out["speedup_vs_plain"] = {k: spread([r[k]["tok_s"] / b for r, b in zip(rows, base) if b]) for k in keys[1:4]}
    if with_llama:
        out["llamacpp_speedup_vs_own_plain"] = spread([r["llamacpp_prompt_lookup"]["tok_s"] / r["llamacpp_plain"]["tok_s"]
                                                       for r in rows if r["llamacpp_plain"]["tok_s"]])
    out["identical"] = {k: sum(r["identical"][k] for r in rows) for k in rows[0]["identical"]} if rows else {}
    drafted = [r["sailfish_drafted"] for r in rows]
    steps = sum(d["verify_steps"] for d in drafted)
    out["overhead_per_verify_step_pct"] = spread([100 * d["draft_s"] / max(d["draft_s"] + d["forward_s"], 1e-9) for d in drafted if d["verify_steps"]])
    out["acceptance"] = sum(d["accepted"] for d in drafted) / max(sum(d["drafted"] for d in drafted), 1)
    out["verify_steps"] = steps
    out["loop_rate"] = spread([r["loop_rate"] for r in rows])
    return out


def replay_all(turns: dict, index, max_draft: int, tok=None) -> dict:
    from ngram.drafter import DrafterConfig, NgramDrafter, PromptLookupDrafter
    from server.tool_schema import make_drafter
    from index.peers import SuffixDecodingDrafter
    from ngram.replay import replay

    out = {}
    seed = list(index.turns())
    for name, t in turns.items():
        out[name] = {
            "sailfish": replay(make_drafter(index, DrafterConfig(max_draft=max_draft), tok), t, max_draft).as_dict(),
            "sailfish_context_only": replay(NgramDrafter(None, DrafterConfig(max_draft=max_draft)), t, max_draft).as_dict(),
            "prompt_lookup": replay(PromptLookupDrafter(max_draft=max_draft), t, max_draft).as_dict(),
            "suffix_decoding": replay(SuffixDecodingDrafter(seed, max_draft), t, max_draft).as_dict(),
        }
    return out


def run_matrix(turns: dict, index, cost: np.ndarray, plain_step_s: float, size: str) -> dict:
    """tau and projected tokens/s per cell. Projection: each replayed step of d drafted tokens costs
    cost[d + 1] plain steps of `plain_step_s` (the verify cost curve measured at start-up)."""
    from ngram.drafter import DrafterConfig, NgramDrafter
    from ngram.replay import replay

    realistic = turns["tool_calls"] + turns["agentic"]
    rng = np.random.default_rng(0)
    sentence = rng.integers(1000, 20000, size=24)
    control = [(np.tile(sentence, 6), np.tile(sentence, 3))]  # a repetitive prompt and its looping output
    drafts = [2, 4, 8, 12, 16] if size == "full" else [4, 16]
    matches = [1, 2, 3, 4] if size == "full" else [2]
    cutoffs = [0.1, 0.3, 0.5] if size == "full" else [0.3]
    cells = []
    for label, data in (("realistic", realistic), ("repetitive control", control)):
        for k in drafts:
            for m in matches:
                for c in cutoffs:
                    cfg = DrafterConfig(max_draft=k, min_match=m, confidence_cutoff=c)
                    st = replay(NgramDrafter(index, cfg), data, k)
                    steps_cost = sum(cost[min(d + 1, len(cost) - 1)] for d in st.draft_lengths)
                    cells.append({"set": label, "max_draft": k, "min_match": m, "cutoff": c, "tau": st.as_dict()["tau"],
                                  "acceptance": st.as_dict()["acceptance_rate"],
                                  "projected_tok_s": st.target_tokens / (steps_cost * plain_step_s)})
    best = max((c for c in cells if c["set"] == "realistic"), key=lambda c: c["projected_tok_s"])
    return {"cells": cells, "best_realistic": best}


def long_context(engine, drafter, tok, contexts: list[int], max_tokens: int) -> list[dict]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / name).read_text() for name in ("argparse.py", "typing.py", "inspect.py", "dataclasses.py", "pathlib.py"))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = []
    for n in contexts:
        prompt = (ids * (1 + n // len(ids)))[:n]
        engine.set_drafter(drafter)
        plain = run_engine(engine, prompt, max_tokens, draft=False)
        drafted = run_engine(engine, prompt, max_tokens, draft=True)
        out.append({"context": n, "prefill_tok_s": n / plain.stats["prefill_s"], "decode_tok_s_plain": plain.decode_tok_s,
                    "decode_tok_s_drafted": drafted.decode_tok_s, "identical": plain.tokens == drafted.tokens})
        log(f"  context {n}: prefill {out[-1]['prefill_tok_s']:.0f} tok/s, decode plain {plain.decode_tok_s:.2f}, drafted {drafted.decode_tok_s:.2f}")
    return out


def concurrency(index_dir: Path, streams: list[int], max_tokens: int) -> dict:
    from openai import OpenAI

    from bench.concurrency import run_at_once
    from bench.server_bench import start_server
    from bench.workloads import prose_requests

    with tempfile.TemporaryDirectory() as tmp:
        proc, base = start_server(["--index", str(index_dir)], Path(tmp) / "server.log")
        try:
            client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
            reqs = prose_requests(max(streams))  # short prompts: the figure is about scheduling, not prefill

            def ask(req):
                r = client.chat.completions.create(model="bench", messages=req["messages"], tools=req["tools"] or None,
                                                   max_tokens=max_tokens)
                return r.choices[0].message.model_dump(), r.usage.completion_tokens

            solo = [ask(r) for r in reqs]
            out = {}
            for n in streams:
                results: dict = {}
                wall = run_at_once([lambda i=i: results.__setitem__(i, ask(reqs[i])) for i in range(n)])
                tokens = sum(results[i][1] for i in range(n))
                out[str(n)] = {"throughput_tok_s": tokens / wall, "wall_s": wall,
                               "identical_to_solo": all(results[i][0] == solo[i][0] for i in range(n))}
                log(f"  {n} streams: {tokens / wall:.2f} tok/s total, identical to solo: {out[str(n)]['identical_to_solo']}")
            return out
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="a small subset, under 3 minutes")
    g.add_argument("--full", action="store_true", help="everything, the whole matrix, 32k context")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--max-prompt", type=int, help="keep the last N prompt tokens (default: per mode)")
    p.add_argument("--sampled-only", action="store_true",
                   help="only the sampled-decoding section (drafted vs plain, same seeds); writes bench-sampled.*")
    args = p.parse_args(argv)
    mode = "quick" if args.quick else "full" if args.full else "default"
    cfg = dict(MODES[mode])
    if args.max_prompt:
        cfg["max_prompt"] = args.max_prompt
    started = time.perf_counter()

    from common.bundled_model import bundled_gguf_path
    from common.chat_format import ChatFormat
    from ngram.drafter import DrafterConfig
    from server.tool_schema import make_drafter
    from index.peers import SuffixDecodingDrafter
    from server.engine import Engine, EngineConfig
    from server.model_loading import load_target

    results: dict = {"mode": mode, "workload_version": WORKLOAD_VERSION, "config": cfg}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        log("building the bench index (BFCL v4 index split + stdlib agent sessions)")
        index, summary = build_bench_index(tmp)
        results["index"] = {"tokens": summary.tokens, "turns": summary.turns, "bytes": summary.bytes}
        target = load_target(None)
        tok = target.tokenizer
        fmt = ChatFormat.for_tokenizer(tok)
        stop_ids = frozenset(fmt.stop_token_ids(tok))
        drafter = make_drafter(index, DrafterConfig(), tok)
        engine = Engine(target, drafter, EngineConfig())
        results["cost_curve"] = [float(c) for c in engine.policy.cost[1:]]
        results["backend"] = type(engine.backend).__name__  # CpuBackend: the int8 path; EagerBackend: fp32
        if args.sampled_only:
            log(f"sampled decoding ({mode}: {cfg['requests']} requests per workload, {cfg['max_tokens']} tokens)")
            results["sampled"] = run_sampled(cfg, engine, drafter, fmt, tok)
            results["seconds"] = time.perf_counter() - started
            from bench.report import sampled_markdown

            md = sampled_markdown(results)
            write_results(args.out, "bench-sampled", results, md)
            print(md)
            return 0
        suffix = SuffixDecodingDrafter(list(index.turns()), DrafterConfig.max_draft)
        llama = None
        try:
            llama = LlamaCpp(str(bundled_gguf_path()))
        except ImportError as e:
            results["llamacpp"] = f"not run: {e}"
        log(f"workloads ({mode}: {cfg['requests']} requests each, {cfg['max_tokens']} tokens)")
        results["workloads"], turns = run_workloads(cfg, engine, drafter, suffix, llama, fmt, tok, stop_ids)
        log("sampled decoding: drafted vs plain, same seeds")
        results["sampled"] = run_sampled(cfg, engine, drafter, fmt, tok)
        log("offline replay")
        results["replay"] = replay_all(turns, index, DrafterConfig.max_draft, tok)
        plain_speeds = [r["sailfish_plain"]["tok_s"] for w in results["workloads"].values() for r in w["requests"]]
        log("matrix")
        results["matrix"] = run_matrix(turns, index, engine.policy.cost, 1.0 / statistics.median(plain_speeds), cfg["matrix"])
        log("long context")
        results["long_context"] = long_context(engine, drafter, tok, cfg["contexts"], 16)
        if cfg["streams"]:
            log("concurrency")
            results["concurrency"] = concurrency(tmp / "index", cfg["streams"], cfg["max_tokens"] // 2)
        else:
            results["concurrency"] = {}
    results["seconds"] = time.perf_counter() - started
    from bench.report import charts, markdown

    md = markdown(results)
    write_results(args.out, "bench" if mode != "quick" else "bench-quick", results, md)
    charts(results, args.out, "bench" if mode != "quick" else "bench-quick")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
