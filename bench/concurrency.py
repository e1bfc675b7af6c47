"""Several streams at once against a real server: aggregate tokens/s, per-stream latency, identity.

    python -m bench.concurrency [--streams 1 2 4 8] [--requests 16] [--max-tokens 64] [--warmup-streams N]
                                [--workload tool_calls|agentic] [--index DIR] [--out bench/results]

For each setting (drafting on and off; `--parallel 1`, the one-at-a-time baseline, and the default
`--parallel`) a real server (`python -m server`) is started on the bundled model and the workload's
requests are sent, first one by one (solo: each request's reference answer), then by N concurrent
client streams for every N in `--streams`: every stream sends requests one after another until
`--requests` requests are done. Before the timed phases one untimed phase runs at `--warmup-streams`
streams (default: the most in `--streams`): a server makes what a forward of several requests needs
once, then reuses it (on the CPU, the buffers its logits go into: server/reused_arrays.py; their
first pages cost page faults), and a long-running server has long since made them. Before 12-04
there was no such phase, and the first phase with more streams than before paid for them.
Reported per N: aggregate completion tokens/s (all streams' tokens over the wall time), that over one stream's, per-request latency p50 / p90 and that over solo's p50, and
how many answers equal their solo answer (they must all: batching changes no output). The drafted
settings run with the online overlay off (`--overlay-tokens 0`): the phases repeat the same requests,
and a drafter that learnt their answers in one phase would speed up the next.

The drafted settings serve one pinned index: `--index DIR`, or by default the public corpus's (the
BFCL v4 starter corpus minus its held-out split, which the tool_calls requests come from), built
into a temporary directory: what `make index` builds on a machine with no traces of its own, so the
figures do not depend on this machine's personal index, nor on whether it has one (a server with no
usable index drafts from the live context alone; before 12-03 it decoded plainly, and the
"drafted" rows measured plain decoding). A drafted setting whose server reports no index in service
stops the benchmark.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.results import run_header, write_results


def run_at_once(targets: list) -> float:
    """One thread per callable, all started, all joined: the wall seconds from the first start to the last end."""
    threads = [threading.Thread(target=t) for t in targets]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _answer(message: dict) -> tuple:
    """What must equal the solo answer: the content and each call's name and arguments (a call's
    id is new in every response)."""
    calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or [])
    return message.get("content"), calls


def build_public_index(out_dir: Path) -> dict:
    """The public corpus's index (BFCL v4 minus its held-out split, no personal traces) in `out_dir`."""
    from index.build import build_index

    summary = build_index([], out_dir, include_bfcl=True, progress=False)
    return {"turns": summary.turns, "tokens": summary.tokens}


def run_setting(extra: list[str], requests: list[dict], streams: list[int], max_tokens: int, log_path: Path,
                warmup_streams: int = 0) -> dict:
    import httpx

    from bench.server_bench import start_server

    proc, base = start_server(extra, log_path)
    try:
        health = httpx.get(base + "/health").json()
        if "--no-draft" not in extra and health["index"] is None:
            raise RuntimeError(f"a drafted setting's server has no index in service: {health['drafting']}")
        client = httpx.Client(base_url=base, timeout=600)

        def ask(req: dict) -> tuple[dict, int, float]:
            body = {"model": "bench", "messages": req["messages"], "tools": req["tools"] or None,
                    "max_tokens": max_tokens}
            t0 = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            data = r.json()
            return _answer(data["choices"][0]["message"]), data["usage"]["completion_tokens"], time.perf_counter() - t0

        def batching() -> dict | None:  # the server's shared-forward counters (None: requests one at a time)
            return httpx.get(base + "/health").json().get("batching")

        ask(requests[0])  # warm-up (first-request costs are not a stream's)
        solo = [ask(r) for r in requests]
        out = {"solo_latency_p50": float(np.median([s[2] for s in solo])), "streams": {}}

        def phase(n: int) -> tuple[dict, float]:
            """The requests sent by n streams at once: ({request: (answer, tokens, latency)}, wall seconds)."""
            answers: dict = {}
            next_request = iter(range(len(requests)))
            lock = threading.Lock()

            def stream():
                while True:
                    with lock:
                        i = next(next_request, None)
                    if i is None:
                        return
                    answers[i] = ask(requests[i])

            return answers, run_at_once([stream] * n)

        if warmup_streams:
            phase(warmup_streams)  # untimed: buffers a concurrent forward needs are made once (see the docstring)
        for n in streams:
            before = batching()
            answers, wall = phase(n)
            shared = forwards_shared(before, batching())
            latencies = [answers[i][2] for i in answers]
            out["streams"][str(n)] = {
                "tokens_per_s": sum(a[1] for a in answers.values()) / wall, "wall_s": wall,
                "latency_p50": float(np.median(latencies)), "latency_p90": float(np.percentile(latencies, 90)),
                "identical": sum(answers[i][0] == solo[i][0] for i in answers), "requests": len(answers), **shared}
            s = out["streams"][str(n)]
            print(f"    {n} streams: {s['tokens_per_s']:.1f} tok/s, p50 {s['latency_p50']:.2f} s, "
                  f"identical {s['identical']}/{s['requests']}", file=sys.stderr)
        health = httpx.get(base + "/health").json()
        out["batching"] = health.get("batching")
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def forwards_shared(before: dict | None, after: dict | None) -> dict:
    """The forwards a phase ran for running requests together (server/batcher.py's counters, read
    from /health before and after it) and what each carried on average: {} without a batcher."""
    if not before or not after:
        return {}
    forwards = after["forwards"] - before["forwards"]
    return {"forwards": forwards,
            "requests_per_forward": (after["sequences"] - before["sequences"]) / forwards if forwards else None,
            "rows_per_forward": (after["rows"] - before["rows"]) / forwards if forwards else None}


def _index_line(index: dict | None) -> str:
    if not index:
        return "Drafted settings: the machine's default index (not recorded)."
    if "turns" in index:
        return (f"Drafted settings: the {index['source']} index, {index['turns']:,} turns, "
                f"{index['tokens']:,} tokens, built for this run.")
    return f"Drafted settings: the index in {index['source']}."


def markdown(r: dict) -> str:
    lines = ["# Several streams at once, bundled model, CPU\n",
             f"{r['when']}, {r['machine']}. Command: `{r['command']}`.\n",
             f"{r['requests']} {r['workload']} requests, {r['max_tokens']} tokens each, the bundled model on the CPU "
             "int8 path; every stream sends requests one after another until all are done"
             + (f", after one untimed phase of {r['warmup_streams']} streams" if r.get("warmup_streams") else "")
             + ". Speed-up = aggregate "
             "tokens/s over the same setting's 1 stream; latency ratio = p50 per-request latency over solo's. "
             + _index_line(r.get("index")) + "\n",
             "Requests / rows a forward: what the server's shared forwards carried on average in that phase "
             "(its batcher's counters; - where requests run one at a time).\n",
             "| setting | streams | aggregate tokens/s | speed-up | latency p50 / p90 (s) | latency / solo | identical to solo "
             "| requests / rows a forward |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in r["settings"].items():
        one = s["streams"].get("1", {}).get("tokens_per_s")
        for n, x in s["streams"].items():
            speed = f"{x['tokens_per_s'] / one:.2f}x" if one else "-"
            lines.append(f"| {name} | {n} | {x['tokens_per_s']:.1f} | {speed} | {x['latency_p50']:.2f} / "
                         f"{x['latency_p90']:.2f} | {x['latency_p50'] / s['solo_latency_p50']:.2f}x | "
                         f"{x['identical']}/{x['requests']} | {_carried(x)} |")
    lines.append("")
    return "\n".join(lines)


def _carried(x: dict) -> str:
    if x.get("requests_per_forward") is None:
        return "-"
    return f"{x['requests_per_forward']:.2f} / {x['rows_per_forward']:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.concurrency", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload", choices=["tool_calls", "agentic"], default="tool_calls")
    p.add_argument("--index", type=Path, help="the drafted settings' index directory "
                   "(default: the public corpus's, built into a temporary directory; see the docstring)")
    p.add_argument("--warmup-streams", type=int, default=None,
                   help="one untimed phase of this many streams before the timed ones (default: the most in --streams; 0: none)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    warmup = max(args.streams) if args.warmup_streams is None else args.warmup_streams
    from bench.workloads import agentic_requests, tool_call_requests

    requests = (tool_call_requests if args.workload == "tool_calls" else agentic_requests)(args.requests)
    # The online overlay is off: every phase repeats the same requests, and a drafter that had learnt
    # their answers in an earlier phase would make the later phases look faster.
    results = {**run_header(),
               "command": "python -m bench.concurrency" + (" " + " ".join(argv) if argv else ""),
               "requests": len(requests), "workload": args.workload, "max_tokens": args.max_tokens,
               "warmup_streams": warmup, "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        index_dir = args.index
        if index_dir is None:
            index_dir = Path(tmp) / "index"
            print("  building the public corpus's index", file=sys.stderr)
            results["index"] = {"source": "public corpus (BFCL v4 minus its held-out split)", **build_public_index(index_dir)}
        else:
            results["index"] = {"source": str(index_dir)}
        pinned = ["--index", str(index_dir)]
        settings = {"drafted, --parallel 4": ["--parallel", "4", "--overlay-tokens", "0", *pinned],
                    "plain, --parallel 4": ["--parallel", "4", "--no-draft"],
                    "drafted, --parallel 1 (one at a time)": ["--parallel", "1", "--overlay-tokens", "0", *pinned]}
        for name, extra in settings.items():
            print(f"  {name}", file=sys.stderr)
            results["settings"][name] = run_setting(extra, requests, args.streams, args.max_tokens,
                                                    Path(tmp) / "server.log", warmup)
    md = markdown(results)
    write_results(args.out, "concurrency", results, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
