"""Agent sessions on the GPU, Gemma 4 E4B shape: prefill speed, cached-turn TTFT, whole sessions.

Random-init `Gemma4ForCausalLM` from the E4B text config (bench/gpu_e4b.py's `build_model`, quanto
int4, bf16 activations), in its "peaked" variant (`make_peaked`: large argmax margins, as a trained
model has), served by `server.engine.Engine` on the fast path exactly as the server builds it
(static cache sized from free memory, CUDA graphs, prefix cache). Requests go through
`Engine.generate` in-process: the HTTP layer adds the same few milliseconds to every contender.
Random weights give the true time of every forward; acceptance of drafts on them is not a trained
model's (the drafter here is the real `NgramDrafter` on the live context only, no index).

Measured in one run:
- prefill tokens/s of a fresh prompt at 1k, 8k, 32k and 64k tokens (median of repeats);
- TTFT of turns that add 1,000 tokens to a cached 64k conversation (prompt = previous prompt +
  the reply + 1,000 new tokens, as an agent sends it);
- whole sessions: (a) "swe": starts at 16k tokens, each turn adds 1,000 and generates up to 64;
  (b) "claude": starts at 80k, each turn adds 100 and generates up to 100 (the measured medians of
  the two workloads, see FACTS). Three contenders run each session in turn: baseline (no prefix
  cache, no drafting: every prompt from position 0), cache, cache + drafting. Reported: each
  session's wall time, TTFT per turn, the speed-ups, and whether every reply is the same.
- memory: after load, after the engine is built, peak; the prefix cache's budget and peak.

Usage (GPU machine): python -m bench.gpu_sessions [--quick] [--out DIR]
Writes DIR/gpu_sessions.json and DIR/gpu_sessions.md (default bench/results/).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

GIB = 2**30


def timed_generate(engine, prompt, max_tokens, draft, prefix_cache=True):
    """(tokens, ttft_s, wall_s, stats) of one request through the engine."""
    from server.engine import GenerationParams

    params = GenerationParams(max_tokens=max_tokens, draft=draft, prefix_cache=prefix_cache)
    out, stats, ttft = [], None, None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for chunk in engine.generate(prompt, params):
        if ttft is None:
            ttft = time.perf_counter() - t0
        out += chunk.token_ids
        stats = chunk.stats
    return out, ttft, time.perf_counter() - t0, stats


def prefill_speed(engine, lengths, repeats, vocab):
    res = {}
    rng = np.random.default_rng(0)
    for n in lengths:
        if n >= engine.max_context:
            continue
        times = []
        for _ in range(repeats + 1):
            ids = rng.integers(3, vocab, n).tolist()
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.backend.start(ids, reuse=False).logits.argmax().item()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            engine.backend.discard()
        times = times[1:]  # the first is a warm-up (compiles the dequantization for these shapes)
        res[n] = {"median_s": statistics.median(times), "tokens_per_s": n / statistics.median(times),
                  "min_s": min(times), "max_s": max(times)}
        print(f"prefill {n}: {res[n]['tokens_per_s']:.0f} tokens/s", flush=True)
    return res


def cached_turn_ttft(engine, base, add, turns, vocab, gen=32):
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, vocab, base).tolist()
    reply, ttft, wall, stats = timed_generate(engine, prompt, gen, draft=False)
    out = []
    for _ in range(turns):
        prompt = prompt + reply + rng.integers(3, vocab, add).tolist()
        reply, ttft, wall, stats = timed_generate(engine, prompt, gen, draft=False)
        out.append({"prompt": len(prompt), "cached": stats.cached_tokens, "ttft_s": ttft, "prefill_s": stats.prefill_s})
        print(f"cached turn at {len(prompt)}: ttft {ttft * 1e3:.1f} ms (cached {stats.cached_tokens})", flush=True)
    return out


def profile_cached_turn(engine, vocab, add=1000):
    """One more 1,000-token turn on the live conversation under torch.profiler: the top kernels,
    and how long dequantizing every int4 weight once takes (printed, for the next optimisation)."""
    from server.fast_prefill import _dequant

    fast = engine.fast
    rng = np.random.default_rng(2)
    live = fast.prefix.tokens[:fast.prefix.live_len].tolist()
    prompt = live + rng.integers(3, vocab, add).tolist()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed_generate(engine, prompt, 1, draft=False)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    lins = [lin for layer in fast.layers if layer.step is not None
            for lin in (layer.step.qkv, layer.step.o, layer.step.gate_up, layer.step.down,
                        layer.step.ple_gate, layer.step.ple_proj) if getattr(lin, "int4", False)]
    deq = _dequant()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for lin in lins:
        deq(lin.weight, lin.scale, lin.offset)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    print(f"dequantizing {len(lins)} int4 weights once: {seconds * 1e3:.1f} ms", flush=True)
    return {"dequant_all_ms": seconds * 1e3, "linears": len(lins)}


def session_prompts(start, add, turns, vocab, seed):
    """Each turn's new tokens (the first turn's: the whole start); the replies are the model's own."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, start if t == 0 else add).tolist() for t in range(turns)]


def run_session(engine, pieces, gen, contender):
    draft = contender == "cache+draft"
    cache = contender != "baseline"
    prompt, replies, turns = [], [], []
    for piece in pieces:
        prompt = prompt + (replies[-1] if replies else []) + piece
        reply, ttft, wall, stats = timed_generate(engine, prompt, gen, draft=draft, prefix_cache=cache)
        replies.append(reply)
        turns.append({"prompt": len(prompt), "cached": stats.cached_tokens, "ttft_s": ttft, "wall_s": wall,
                      "decode_tps": stats.tokens_per_s, "generated": len(reply),
                      "accepted": stats.accepted_tokens, "drafted": stats.drafted_tokens})
    return replies, turns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke test of the whole run)")
    ap.add_argument("--profile", action="store_true", help="profile one cached turn (printed)")
    args = ap.parse_args(argv)

    from bench.gpu_e4b import build_model, make_peaked, random_e4b_target
    from ngram.drafter import NgramDrafter
    from server.engine import Engine, EngineConfig

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version()}
    import transformers
    res["transformers"] = transformers.__version__
    t = time.perf_counter()
    model = build_model(quant=True)
    make_peaked(model)
    torch.cuda.synchronize()
    res["load_s"] = time.perf_counter() - t
    res["mem_after_load_GiB"] = torch.cuda.memory_allocated() / GIB
    vocab = model.config.vocab_size

    target = random_e4b_target(model)
    t = time.perf_counter()
    engine = Engine(target, None, EngineConfig(fast_max_context=16384 if args.quick else None))
    res["engine_build_s"] = time.perf_counter() - t
    res["engine_notes"] = engine.notes
    res["context"] = engine.max_context
    res["mem_after_engine_GiB"] = torch.cuda.memory_allocated() / GIB
    print("\n".join(engine.notes), flush=True)
    drafter = NgramDrafter(None)

    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # after every section, so a run cut short still leaves what it measured
        (args.out / "gpu_sessions.json").write_text(json.dumps(res, indent=1, default=str))

    lengths = (1024, 8192) if args.quick else (1024, 8192, 32768, 65536)
    res["prefill"] = prefill_speed(engine, lengths, 2, vocab)
    save()
    base = 8192 if args.quick else 65536
    res["cached_turn"] = cached_turn_ttft(engine, base, 1000, 3 if args.quick else 5, vocab)
    if args.profile:
        res["profile"] = profile_cached_turn(engine, vocab)
    save()

    sessions = {"swe": (16384 if not args.quick else 4096, 1000, 4 if args.quick else 10, 64),
                "claude": (81920 if not args.quick else 8192, 100, 4 if args.quick else 6, 100)}
    res["sessions"] = {}
    for name, (start, add, turns, gen) in sessions.items():
        if start + turns * (add + gen) >= engine.max_context:
            continue
        pieces = session_prompts(start, add, turns, vocab, seed=len(name))
        per = {}
        for contender in ("baseline", "cache", "cache+draft"):
            engine.set_drafter(drafter if contender == "cache+draft" else None)
            replies, turns_out = run_session(engine, pieces, gen, contender)
            per[contender] = {"replies": replies, "turns": turns_out,
                              "wall_s": sum(x["wall_s"] for x in turns_out)}
            print(f"session {name} {contender}: {per[contender]['wall_s']:.2f} s", flush=True)
        engine.set_drafter(None)
        base_replies = per["baseline"]["replies"]
        summary = {}
        for contender, r in per.items():
            same = sum(a == b for a, b in zip(r["replies"], base_replies))
            summary[contender] = {
                "wall_s": r["wall_s"], "speedup": per["baseline"]["wall_s"] / r["wall_s"],
                "ttft_median_s": statistics.median(x["ttft_s"] for x in r["turns"]),
                "ttft_after_first_median_s": statistics.median(x["ttft_s"] for x in r["turns"][1:]),
                "decode_tps_median": statistics.median(x["decode_tps"] for x in r["turns"]),
                "replies_equal_baseline": f"{same}/{len(base_replies)}", "turns": r["turns"]}
        res["sessions"][name] = {"start": start, "add": add, "gen": gen, "contenders": summary}
        save()
    res["prefix_cache"] = engine.prefix_summary()
    res["mem_peak_GiB"] = torch.cuda.max_memory_allocated() / GIB

    save()
    (args.out / "gpu_sessions.md").write_text(render(res))
    print(render(res))
    return 0


def render(r) -> str:
    lines = ["# Agent sessions on the GPU (E4B shape, int4, random weights)", "",
             f"{r['device']}, torch {r['torch']}, transformers {r['transformers']}. Context served: "
             f"{r['context']} tokens. Engine built in {r['engine_build_s']:.1f} s. Memory: "
             f"{r['mem_after_load_GiB']:.2f} GiB after load, {r['mem_after_engine_GiB']:.2f} GiB with the engine, "
             f"peak {r['mem_peak_GiB']:.2f} GiB.", "", "| prefill of a fresh prompt | tokens/s (median) | spread (s) |",
             "|---|---|---|"]
    for n, p in r["prefill"].items():
        lines.append(f"| {int(n):,} tokens | {p['tokens_per_s']:,.0f} | {p['min_s']:.3f}-{p['max_s']:.3f} |")
    ct = r["cached_turn"]
    if ct:
        ttfts = sorted(x["ttft_s"] * 1e3 for x in ct)
        lines += ["", f"A turn adding 1,000 tokens to a cached {ct[0]['prompt'] - 1000:,}-token conversation: TTFT "
                  f"median {statistics.median(ttfts):.1f} ms (range {ttfts[0]:.1f}-{ttfts[-1]:.1f}, {len(ct)} turns)."]
    for name, s in r["sessions"].items():
        lines += ["", f"Session `{name}`: starts at {s['start']:,} tokens, +{s['add']} per turn, up to {s['gen']} generated.",
                  "", "| contender | session wall (s) | speed-up | TTFT median, turns 2+ (ms) | decode tok/s | replies = baseline |",
                  "|---|---|---|---|---|---|"]
        for c, x in s["contenders"].items():
            lines.append(f"| {c} | {x['wall_s']:.2f} | {x['speedup']:.2f}x | {x['ttft_after_first_median_s'] * 1e3:.1f} | "
                         f"{x['decode_tps_median']:.0f} | {x['replies_equal_baseline']} |")
    pc = r.get("prefix_cache") or {}
    if pc:
        lines += ["", f"Prefix cache: budget {pc['budget_bytes'] / GIB:.1f} GiB, peak {pc['peak_bytes'] / GIB:.2f} GiB, "
                  f"{pc['hits']} hits of {pc['requests']} requests, {pc['reused_tokens']:,} tokens reused, "
                  f"{pc['computed_tokens']:,} computed."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
