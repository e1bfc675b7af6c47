"""Several streams at once on the GPU fast path's lanes: aggregate tokens/s, latency, identity.

    python -m bench.gpu_concurrency [--streams 1,2,4,8,16] [--tokens 128] [--prompt 1000] [--plain] [--rounds 3]
                                    [--ple host|staged|gpu] [--kernels] [--max-len N] [--out DIR]
                                                                                    (GPU machine)
    python -m bench.gpu_concurrency --tiny                                          (any machine: a smoke run)

Contract: builds the E4B shape (random init, quanto int4, the per-layer table on the host, as
bench.gpu_e4b builds it, read by the GPU in place where it can be as the engine's is, with its rows
staged before each replay with `--ple staged`, or on the GPU with `--ple gpu`) and one FastTarget, then lanes for the
largest stream count (server/fast_batch.py, what `--parallel N` builds). First each stream's reference: its prompt (random
ids, `--prompt` tokens, a different one per stream) decoded alone on the first lane, greedy, plain.
Then for each count S, S threads each decode their own prompt on their own lane at once, greedy,
with oracle drafts (the stream's reference with 20% of the tokens wrong: bench.fast_greedy.oracle;
at most min(15, 64 / S - 1) tokens, so one forward of the step kernels' 64 rows carries every
stream's verify) or plainly (`--plain`), each ending in discard (the lane leaves the rendezvous).
Per count: wall time from the first thread's start to the last one's end (prefills included),
aggregate tokens/s = S x `--tokens` / wall, its ratio to one stream's, p50 of the streams' own
times and its ratio to one stream's, the forwards the lanes' batcher ran, their mean time (host work
and GPU; of it the host's staging of a stacked forward before its replay) and their share of the
wall, the most streams one carried, and whether every stream's tokens equal its reference. Issue bars (GPU, drafting on):
4 streams >= 3x one stream's tokens/s and p50 latency <= 1.5x; 16 streams >= 8x; identical always.
First each stream drafted alone on its own lane (the largest count's drafts), against its plain
reference: a difference there is drafting's or a lane's, not sharing's. Each count runs one untimed round (it captures the stacked forwards' graphs: server/batch_step.py),
then `--rounds` timed ones (median, range). Before the streams, a table of forward costs: one
forward carrying S lanes' steps of T tokens each against a lone step of T tokens (S = 1).
The lanes are what `--parallel N` builds (server/fast_batch.py fast_lanes); whether they pay, and
whether every stream keeps its solo tokens, is what this measures.
`--max-len N`: each lane's cache (default: what the streams need); the server sizes it to the
model's context where memory allows, and a stacked forward's graph spans all of it.
`--kernels`: one more round of the largest count under torch.profiler, its forwards' GPU time by
kernel (bench/kernel_time.py). Writes DIR/gpu_concurrency.json and .md (default bench/results/); `--tiny` measures a tiny random
Gemma 4 on the CPU instead (uncaptured, fp32): it checks the harness, and its times mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


PLE_PLACES = {"host": "on the host", "staged": "on the host, staged", "gpu": "on the GPU"}


def build(tiny: bool, max_len: int, prefix_bytes: int = 0, ple: str = "host"):
    """(a FastTarget, its model's vocabulary size); `prefix_bytes`: its prefix cache's budget (the
    lanes share its store); `ple`: where the per-layer table sits: "host" (the engine's placement:
    read by the GPU in place where it can be, server/host_rows.py), "staged" (on the host, each
    forward's rows gathered there and copied before its replay) or "gpu" (looked up inside the
    captured forwards)."""
    from server.fast_path import FastTarget

    if tiny:
        from bench.step_ab import _tiny_gemma4

        model = _tiny_gemma4()
        return FastTarget(model, max_len=max_len, prefill_chunk=32, capture=False, min_kv_len=64,
                          buckets=(2, 4, 8, 16), prefix_budget_bytes=prefix_bytes), model.config.vocab_size
    from bench.gpu_e4b import build_model

    model = build_model(quant=True)
    if ple != "gpu":
        model.model.embed_tokens_per_layer.to("cpu")
        torch.cuda.empty_cache()
    fast = FastTarget(model, max_len=max_len, min_kv_len=1024, ple_on_host=ple != "gpu", buckets=(2, 4, 8, 16),
                      prefix_budget_bytes=prefix_bytes, map_host_tables=False if ple == "staged" else None)
    fast.warmup()  # its graphs now, not inside the streams' threads (fast_lanes warms the other lanes)
    return fast, model.config.vocab_size


def decode(lane, prompt: list[int], tokens: int, propose=None, max_draft: int = 15,
           reuse: bool = False) -> tuple[list[int], float, float]:
    """(greedy tokens, seconds, seconds of them in its prefill) of one stream on one lane; the lane
    leaves the rendezvous at the end. `reuse`: the prefill resumes from the prefix cache."""
    from bench.fast_greedy import greedy_generate

    t0, prefill0 = time.perf_counter(), lane.timings.prefill_s
    try:
        out, _ = greedy_generate(lane, prompt, tokens, propose, max_draft=max_draft, reuse=reuse)
    finally:
        lane.discard()
    return out, time.perf_counter() - t0, lane.timings.prefill_s - prefill0


def draft_cap(streams: int, rows: int | str) -> int:
    """The most drafted tokens per stream when `streams` share forwards of about `rows` rows;
    rows "auto": as many as the server fills a forward of that many lanes with
    (server/fast_batch.py `FastBatch.rows_for`: 16 for one or two, 32 for more)."""
    if rows == "auto":
        from server.fast_batch import shared_rows
        rows = shared_rows(streams)
    return max(1, min(15, int(rows) // streams - 1))


def warm(lane, history: list[int]) -> None:
    """The conversation so far served on `lane` and kept by its prefix cache (untimed): the next
    turn's prefill resumes after it, as an agent's does."""
    lane.start(history, reuse=True)
    lane.finish(history, 0)


def run_streams(lanes, prompts, references, tokens: int, plain: bool, vocab: int, rows: int | str = 64,
                histories: list | None = None, around=contextlib.nullcontext) -> dict:
    """One round: every stream at once, after each lane served its history untimed (`histories`).
    `around()`: a context manager entered around the streams alone (not the histories' prefills):
    `profiled_round`'s profiler."""
    from bench.concurrency import run_at_once
    from bench.fast_greedy import oracle

    S = len(prompts)
    max_draft = draft_cap(S, rows)
    if histories is not None:
        for lane, history in zip(lanes, histories):
            warm(lane, history)
    results: list = [None] * S
    errors: list = []
    before = dict(lanes[0].batcher.summary()) if lanes[0].batcher is not None else None
    batch = lanes[0].batch
    timing0 = _forward_timing(batch)
    store = lanes[0].store  # the lanes' shared prefix store (None when the cache is off)
    computed0 = store.summary()["computed_tokens"] if store is not None else 0

    def stream(i: int) -> None:
        try:
            propose = None if plain else oracle(references[i], len(prompts[i]), vocab=vocab, seed=i)
            results[i] = decode(lanes[i], prompts[i], tokens, propose, max_draft, reuse=histories is not None)
        except BaseException as e:  # reported, not swallowed
            errors.append(e)

    with around():
        wall = run_at_once([lambda i=i: stream(i) for i in range(S)])
    if errors:
        raise errors[0]
    after = lanes[0].batcher.summary() if lanes[0].batcher is not None else None
    timing = [b - a for a, b in zip(timing0, _forward_timing(batch))]
    return {"forward_ms": 1e3 * timing[0] / timing[1] if timing[1] else None,
            "forward_share": timing[0] / wall,
            "staging_ms": 1e3 * timing[2] / timing[3] if timing[3] else None, "streams": S, "max_draft": 0 if plain else max_draft, "wall_s": wall,
            "aggregate_tps": S * tokens / wall, "stream_s": [r[1] for r in results],
            "p50_s": statistics.median(r[1] for r in results),
            "prefill_p50_s": statistics.median(r[2] for r in results),
            "identical": [r[0] == references[i] for i, r in enumerate(results)],
            "first_difference": {i: next(j for j, (a, b) in enumerate(zip(r[0], references[i])) if a != b)
                                 for i, r in enumerate(results) if r[0] != references[i]},
            "prompt_tokens_computed": None if store is None else store.summary()["computed_tokens"] - computed0,
            "forwards": None if after is None else after["forwards"] - before["forwards"],
            "peak_streams": None if after is None else after["peak_sequences"]}


def _forward_timing(batch) -> tuple[float, int, float, int]:
    """(seconds in the lanes' forwards, forwards, seconds staging stacked forwards, stacked forwards)
    so far (server/fast_batch.py, server/batch_step.py); zeros without lanes."""
    if batch is None:
        return 0.0, 0, 0.0, 0
    stacked = batch.stacked
    return (batch.forward_s, batch.forwards_run, stacked.staging_s if stacked else 0.0,
            stacked.replays if stacked else 0)


def forward_costs(lanes, prompts, shapes: list[tuple[int, int]], reps: int = 10) -> list[dict]:
    """Milliseconds of one forward carrying S lanes' steps of T tokens each (S = 1: a lone step,
    its captured graph), median and range of `reps` after one untimed (its graph's capture)."""
    from server.fast_batch import LaneStep

    for lane, prompt in zip(lanes, prompts):
        lane.start(prompt, reuse=False)
    out = []
    try:
        for S, T in shapes:
            times = []
            for rep in range(reps + 1):
                steps = [LaneStep(lane, [7] * T, None) for lane in lanes[:S]]
                _sync()
                t0 = time.perf_counter()
                lanes[0].batch.forward_batch(steps) if S > 1 else lanes[0].step_alone([7] * T)
                _sync()
                if rep:
                    times.append((time.perf_counter() - t0) * 1e3)
                for lane in lanes[:S]:
                    lane.rollback(T)
            out.append({"lanes": S, "tokens_each": T, "ms": statistics.median(times),
                        "ms_range": [min(times), max(times)]})
    finally:
        for lane in lanes:
            lane.discard()
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summarize(first: dict, rounds: list[dict]) -> dict:
    """One stream count: the median round's figures, the spread of aggregate tokens/s, identity in every round."""
    by_tps = sorted(rounds, key=lambda run: run["aggregate_tps"])
    mid = dict(by_tps[len(by_tps) // 2])
    mid["tps_range"] = [by_tps[0]["aggregate_tps"], by_tps[-1]["aggregate_tps"]]
    mid["p50_s"] = statistics.median(run["p50_s"] for run in rounds)
    mid["prefill_p50_s"] = statistics.median(run["prefill_p50_s"] for run in rounds)
    for key in ("forward_ms", "forward_share", "staging_ms"):
        values = [run[key] for run in rounds if run.get(key) is not None]
        mid[key] = statistics.median(values) if values else None
    mid["identical"] = [all(col) for col in zip(first["identical"], *(run["identical"] for run in rounds))]
    mid["identical_by_round"] = [first["identical"]] + [run["identical"] for run in rounds]
    mid["first_difference_by_round"] = [first["first_difference"]] + [run["first_difference"] for run in rounds]
    mid["first_round"] = {"aggregate_tps": first["aggregate_tps"], "p50_s": first["p50_s"]}
    return mid


def profiled_round(go) -> dict:
    """One round of `go` (a run_streams call, given the profiler as its `around`) under
    torch.profiler, not timed for the table: its forwards' GPU time by kernel name
    (bench/kernel_time.py: overlapping launches counted once, gaps between kernels not charged), ms
    a forward, beside the round's wall ms a forward. Tells where forwards that take longer beside
    other streams than alone spend it. The lanes' untimed history prefills stay outside the profile."""
    from bench.kernel_time import charge, cuda_kernels

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    run = go(lambda: prof)
    forwards = run["forwards"] or 1  # (None where the lanes have no batcher)
    charged = charge(cuda_kernels(prof), None)
    return {"streams": run["streams"], "forwards": run["forwards"], "wall_ms": 1e3 * run["wall_s"] / forwards,
            "busy_ms": sum(charged.values()) / 1e3 / forwards,
            "by_kernel": {name: us / 1e3 / forwards for name, us in list(charged.items())[:14]}}


def markdown(r: dict) -> str:
    one = r["runs"][0]
    lines = ["# Several streams at once on the GPU fast path's lanes", "",
             f"{r['when']}, {r['machine']}, {r['device']}. Command: `{r['command']}`.", "",
             f"{r['model']}; " + (f"prompts of {r['prompt']} random tokens" if not r.get("turn") else
                                  f"each stream an agent's next turn: {r['prompt']} random tokens of conversation "
                                  f"its lane's prefix cache holds (served untimed before each round) and {r['turn']} new")
             + f", {r['tokens']} tokens a stream, each lane's cache {r.get('max_len', '-')} tokens, greedy, "
             + ("plain." if r["plain"] else "oracle drafts (the stream's own output, 20% of tokens wrong).")
             + ("" if r["plain"] else f" Max draft per stream: {_rows_words(r.get('rows', 64))} / streams - 1, "
                f"within 1..15 (the streams' drafts fill about that many rows a forward, and each stream adds at "
                f"least 2).")
             + f" Per count: one untimed round (it captures the stacked forwards' graphs), then {r['rounds']} "
             "timed: the median round, the range of aggregate tokens/s, the median of the rounds' p50.", "",
             "| streams | max draft | aggregate tokens/s (range) | x one stream | stream p50 (s) | p50 / one stream | "
             "its prefill p50 (s) | "
             "forwards | ms a forward (of it host staging) | forwards' share of the wall | "
             "most streams in one forward (so far) | identical to solo (every round) | first round tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in r["runs"]:
        lo, hi = run["tps_range"]
        lines.append(f"| {run['streams']} | {run['max_draft']} | {run['aggregate_tps']:.1f} ({lo:.0f}-{hi:.0f}) | "
                     f"{run['aggregate_tps'] / one['aggregate_tps']:.2f}x | {run['p50_s']:.2f} | "
                     f"{run['p50_s'] / one['p50_s']:.2f}x | {run['prefill_p50_s']:.3f} | {run['forwards']} | "
                     f"{_ms(run.get('forward_ms'))} ({_ms(run.get('staging_ms'))}) | "
                     + (f"{run['forward_share']:.0%}" if run.get("forward_share") is not None else "-")
                     + f" | {run['peak_streams']} | "
                     f"{sum(run['identical'])}/{run['streams']} | {run['first_round']['aggregate_tps']:.1f} |")
    if r.get("drafted_alone"):
        alone = r["drafted_alone"]
        lines += ["", f"Each stream drafted alone on its own lane (max draft {alone['max_draft']}): "
                      f"{sum(alone['identical'])}/{len(alone['identical'])} identical to its plain reference."]
    if r.get("forward_costs"):
        lines += ["", "One forward of S lanes' steps of T tokens each (S = 1: a lone step, its graph), "
                      f"after {r['prompt']} tokens of prompt each:", "",
                  "| lanes S | tokens each T | ms a forward (range) | x a lone step of T |", "|---|---|---|---|"]
        lone = {c["tokens_each"]: c["ms"] for c in r["forward_costs"] if c["lanes"] == 1}
        for c in r["forward_costs"]:
            ratio = f"{c['ms'] / lone[c['tokens_each']]:.2f}x" if c["tokens_each"] in lone else "-"
            lines.append(f"| {c['lanes']} | {c['tokens_each']} | {c['ms']:.2f} ({c['ms_range'][0]:.2f}-"
                         f"{c['ms_range'][1]:.2f}) | {ratio} |")
    if r.get("kernels"):
        k = r["kernels"]
        lines += ["", f"Where the forwards' GPU time goes, {k['streams']} streams (one more round under torch.profiler, "
                      f"{k['forwards']} forwards: {k['wall_ms']:.2f} ms of wall a forward, the GPU busy "
                      f"{k['busy_ms']:.2f} of them; overlapping launches counted once), ms a forward:", "",
                  "| kernel | ms a forward |", "|---|---|"]
        lines += [f"| `{name}` | {ms:.3f} |" for name, ms in k["by_kernel"].items()]
    if r.get("stacked"):
        st = r["stacked"]
        lines += ["", f"Stacked forwards (server/batch_step.py): {st['stacked_forwards']}, {st['graphs']} graphs "
                      f"captured in {st['capture_s']:.1f} s, {st['replays']} replays."]
    return "\n".join(lines) + "\n"


def _rows_words(rows: int | str) -> str:
    return "R (as the server: 16 for one or two streams, 32 for more)" if rows == "auto" else str(rows)


def _rows_arg(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_concurrency", description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--plain", action="store_true", help="no drafts")
    ap.add_argument("--rows", type=_rows_arg, default=64,
                    help="rows the streams' drafts fill a forward with: max draft per stream = rows / streams - 1 "
                         "(1..15); 'auto': the server's rows for that many lanes (16 for one or two, 32 for more)")
    ap.add_argument("--turn", type=int, default=0,
                    help="each stream is an agent's next turn: --prompt tokens its lane's prefix cache holds, then "
                         "this many new ones (default 0: every prompt prefilled from position 0)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per stream count, after an untimed one")
    ap.add_argument("--ple", choices=("host", "staged", "gpu"), default="host",
                    help="where the per-layer embedding table sits: host (the engine's choice: read by the GPU in place "
                         "where it can be), staged (on the host, its rows gathered and copied in each forward's "
                         "staging) or gpu (5.25 GiB on E4B, looked up inside the graphs)")
    ap.add_argument("--max-len", type=int, default=0,
                    help="the lanes' cache in tokens (default 0: what the streams need); the server sizes it to the "
                         "model's context where memory allows, and a stacked forward's full layers span all of it")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the harness only")
    ap.add_argument("--no-costs", action="store_true", help="skip the table of forward costs")
    ap.add_argument("--kernels", action="store_true",
                    help="one more round of the largest count under torch.profiler: GPU time by kernel a forward")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.tiny and args.streams == "1,2,4,8,16":
        args.streams, args.tokens, args.prompt, args.rounds = "1,2,4", 24, 40, 1
    if args.kernels and (args.tiny or not torch.cuda.is_available()):
        ap.error("--kernels profiles GPU kernels: it needs the GPU (not --tiny)")
    counts = [int(c) for c in args.streams.split(",")]
    from bench.results import run_header, write_results
    from server.fast_batch import fast_lanes

    need = args.prompt + args.turn + args.tokens + 64
    if args.max_len and args.max_len < need:
        ap.error(f"--max-len {args.max_len}: the streams need {need} tokens of cache")
    fast, vocab = build(args.tiny, args.max_len or need, 2**30 if args.turn else 0,
                        ple=args.ple)
    lanes = fast_lanes(fast, max(counts))
    g = torch.Generator().manual_seed(0)
    histories = [torch.randint(3, vocab, (args.prompt,), generator=g).tolist() for _ in range(max(counts))]
    prompts = ([h + torch.randint(3, vocab, (args.turn,), generator=g).tolist() for h in histories]
               if args.turn else histories)
    reuse = bool(args.turn)  # each lane serves its history untimed before a stream's request

    def solo(lane, i: int, propose=None, max_draft: int = 15) -> list[int]:
        if reuse:
            warm(lane, histories[i])
        return decode(lane, prompts[i], args.tokens, propose, max_draft, reuse=reuse)[0]

    references = [solo(lanes[0], i) for i in range(len(prompts))]
    # Each stream drafted alone on its own lane, with the drafts of the largest count: tells a
    # difference that drafting or a lane's lone steps make from one that sharing forwards makes.
    from bench.fast_greedy import oracle
    solo_draft = draft_cap(max(counts), args.rows)
    alone = [solo(lane, i, oracle(ref, len(p), vocab=vocab, seed=i), solo_draft)
             for i, (lane, p, ref) in enumerate(zip(lanes, prompts, references))] if not args.plain else references
    drafted_alone = {"max_draft": solo_draft, "identical": [a == ref for a, ref in zip(alone, references)]}
    shapes = [(S, T) for S in counts for T in sorted({2, min(16, 64 // S)})]
    costs = forward_costs(lanes, prompts, shapes) if lanes[0].batch is not None and not args.no_costs else []
    runs = []
    for S in counts:  # a first, untimed round captures the stacked forwards' graphs (a server's steady state)
        go = lambda around=contextlib.nullcontext: run_streams(
            lanes[:S], prompts[:S], references[:S], args.tokens, args.plain, vocab, args.rows,
            histories[:S] if reuse else None, around)
        first = go()
        runs.append(summarize(first, [go() for _ in range(args.rounds)]))
    kernels = profiled_round(go) if args.kernels else None  # (go: the largest count's round)
    stacked = lanes[0].batch.stacked if lanes[0].batch is not None else None
    device = "CPU (tiny model)" if args.tiny else torch.cuda.get_device_name()
    r = {**run_header(), "command": "python -m bench.gpu_concurrency" + "".join(f" {a}" for a in argv),
         "device": device, "model": "a tiny random Gemma 4, fp32, uncaptured" if args.tiny else
         f"E4B shape, random init, int4, per-layer table {PLE_PLACES[args.ple]}"
         + (f" ({fast.host_table_note})" if fast.host_table_note else ""),
         "prompt": args.prompt, "tokens": args.tokens, "max_len": fast.max_len,
         "plain": args.plain, "rounds": args.rounds, "rows": args.rows, "turn": args.turn, "runs": runs,
         "forward_costs": costs,
         "drafted_alone": drafted_alone, "kernels": kernels,
         "stacked": None if stacked is None else stacked.summary()}
    md = markdown(r)
    name = "gpu_concurrency" + (f"-rows{args.rows}" if args.rows != 64 else "") + \
        (f"-turn{args.turn}" if args.turn else "") + ("" if args.ple == "host" else f"-ple{args.ple}") + \
        (f"-len{args.max_len}" if args.max_len else "") + \
        ("-tiny" if args.tiny else "")
    write_results(args.out, name, r, md)
    print(md)
    return 0 if all(all(run["identical"]) for run in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
