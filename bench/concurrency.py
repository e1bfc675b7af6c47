"""Several streams at once against a real server: aggregate tokens/s, per-stream latency, identity.

    python -m bench.concurrency [--streams 1 2 4 8] [--requests 16] [--max-tokens 64] [--warmup-streams N] [--rounds N]
                                [--workload tool_calls|agentic] [--index DIR] [--out bench/results]
                                [--llama-server PATH [--llama-modes plain,ngram-simple]]

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

With `--llama-server PATH` (a llama-server binary: llama.cpp's own server, which the pip package
does not ship; build it from llama-cpp-python's vendored llama.cpp) the same phases run against it
on the bundled GGUF, one setting per `--llama-modes` entry, with as many parallel slots (-np) as
Sailfish's `--parallel` (its continuous batching), and the first mode once more with one slot (one
request at a time), its prompt cache on, the same prompt token ids,
greedy, the same stop strings and threads; a table then sets Sailfish's drafted aggregate tokens/s
beside the best llama-server setting's at each stream count.
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

PARALLEL = 4  # requests a server decodes at once: Sailfish's --parallel, llama-server's -np
OURS = f"drafted, --parallel {PARALLEL}"


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


def run_phases(ask, n_requests: int, streams: list[int], warmup_streams: int = 0,
               batching=lambda: None, rounds: int = 1) -> dict:
    """The phases of one setting. `ask(i)` sends request i and returns (what must equal its solo
    answer, completion tokens); `batching()` reads the server's shared-forward counters (None where
    it has none). Each request is first sent alone (its solo answer and latency), then by n streams
    at once for every n in `streams`, after an untimed phase of `warmup_streams`; `rounds` times
    over, the counts in turn within each round (a slow spell of the machine falls on all of them).
    Per count: the rounds' median aggregate tokens/s and their range, latencies over every
    round's requests, answers identical to solo and requests summed over the rounds."""

    def timed(i: int) -> tuple:
        t0 = time.perf_counter()
        answer, tokens = ask(i)
        return answer, tokens, time.perf_counter() - t0

    timed(0)  # warm-up (first-request costs are not a stream's)
    solo = [timed(i) for i in range(n_requests)]
    out = {"solo_latency_p50": float(np.median([s[2] for s in solo])), "rounds": rounds, "streams": {}}

    def phase(n: int) -> tuple[dict, float]:
        """The requests sent by n streams at once: ({request: (answer, tokens, latency)}, wall seconds)."""
        answers: dict = {}
        next_request = iter(range(n_requests))
        lock = threading.Lock()

        def stream():
            while True:
                with lock:
                    i = next(next_request, None)
                if i is None:
                    return
                answers[i] = timed(i)

        return answers, run_at_once([stream] * n)

    if warmup_streams:
        phase(warmup_streams)  # untimed: buffers a concurrent forward needs are made once (see the docstring)
    seen: dict[int, list] = {n: [] for n in streams}  # per count: (tokens/s, wall, answers, shared) a round
    for _ in range(rounds):
        for n in streams:
            before = batching()
            answers, wall = phase(n)
            seen[n].append((sum(a[1] for a in answers.values()) / wall, wall, answers,
                            forwards_shared(before, batching())))
            print(f"    {n} streams: {seen[n][-1][0]:.1f} tok/s", file=sys.stderr)
    for n in streams:
        speeds = [r[0] for r in seen[n]]
        latencies = [a[2] for r in seen[n] for a in r[2].values()]
        out["streams"][str(n)] = {
            "tokens_per_s": float(np.median(speeds)), "tokens_per_s_range": [min(speeds), max(speeds)],
            "wall_s": float(np.median([r[1] for r in seen[n]])),
            "latency_p50": float(np.median(latencies)), "latency_p90": float(np.percentile(latencies, 90)),
            "identical": sum(a[0] == solo[i][0] for r in seen[n] for i, a in r[2].items()),
            "requests": sum(len(r[2]) for r in seen[n]), **_summed_shared([r[3] for r in seen[n]])}
        s = out["streams"][str(n)]
        print(f"    {n} streams: {s['tokens_per_s']:.1f} tok/s (median of {rounds}), p50 {s['latency_p50']:.2f} s, "
              f"identical {s['identical']}/{s['requests']}", file=sys.stderr)
    return out


def _summed_shared(per_round: list[dict]) -> dict:
    """forwards_shared of several rounds as one: forwards summed, per-forward means over all of them."""
    if not per_round or not all(per_round):
        return {}
    forwards = sum(r["forwards"] for r in per_round)
    if not forwards:
        return {"forwards": 0, "requests_per_forward": None, "rows_per_forward": None}
    return {"forwards": forwards,
            "requests_per_forward": sum(r["requests_per_forward"] * r["forwards"] for r in per_round if r["forwards"]) / forwards,
            "rows_per_forward": sum(r["rows_per_forward"] * r["forwards"] for r in per_round if r["forwards"]) / forwards}


def run_setting(extra: list[str], requests: list[dict], streams: list[int], max_tokens: int, log_path: Path,
                warmup_streams: int = 0, rounds: int = 1) -> dict:
    import httpx

    from bench.server_bench import start_server

    proc, base = start_server(extra, log_path)
    try:
        health = httpx.get(base + "/health").json()
        if "--no-draft" not in extra and health["index"] is None:
            raise RuntimeError(f"a drafted setting's server has no index in service: {health['drafting']}")
        client = httpx.Client(base_url=base, timeout=600)

        def ask(i: int) -> tuple[tuple, int]:
            req = requests[i]
            body = {"model": "bench", "messages": req["messages"], "tools": req["tools"] or None,
                    "max_tokens": max_tokens}
            r = client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            data = r.json()
            return _answer(data["choices"][0]["message"]), data["usage"]["completion_tokens"]

        def batching() -> dict | None:  # the server's shared-forward counters (None: requests one at a time)
            return httpx.get(base + "/health").json().get("batching")

        out = run_phases(ask, len(requests), streams, warmup_streams, batching, rounds)
        out["batching"] = httpx.get(base + "/health").json().get("batching")
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_llama_setting(binary: str, mode: str, parallel: int, requests: list[dict], streams: list[int],
                      max_tokens: int, warmup_streams: int = 0, rounds: int = 1) -> dict:
    """The same phases against llama.cpp's own server (`binary`) on the bundled GGUF, with `parallel`
    slots (-np: its continuous batching) and `mode`'s drafting (bench.contenders.LlamaServer.MODES),
    its prompt cache on; the prompts are the token ids Sailfish's chat format gives each request,
    greedy, ending at the same stop strings. Its answer is its text (it is compared with its own
    solo text)."""
    import os

    from bench.contenders import LlamaServer
    from common.bundled_model import bundled_gguf_path
    from common.chat_format import ChatFormat
    from common.tokenizer import load_tokenizer
    from server.protocol import parse_messages, parse_tools

    tok = load_tokenizer()
    fmt = ChatFormat.for_tokenizer(tok)
    prompts = [tok.encode(fmt.render_prompt(parse_messages(r["messages"]), parse_tools(r["tools"] or []), "auto"),
                          add_special_tokens=False) for r in requests]
    stop = list(fmt.stop_strings())
    server = LlamaServer(binary, str(bundled_gguf_path()), mode, os.cpu_count() or 1, parallel=parallel)
    server.resume()  # (it is paused once ready: nothing else runs beside it here)
    try:
        return run_phases(lambda i: server.complete(prompts[i], max_tokens, stop), len(requests), streams,
                          warmup_streams, rounds=rounds)
    finally:
        server.close()


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
             + (f"; {r['rounds']} timed rounds of every count, medians (range)" if r.get("rounds", 1) > 1 else "")
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
            lines.append(f"| {name} | {n} | {_speed(x)} | {speed} | {x['latency_p50']:.2f} / "
                         f"{x['latency_p90']:.2f} | {x['latency_p50'] / s['solo_latency_p50']:.2f}x | "
                         f"{x['identical']}/{x['requests']} | {_carried(x)} |")
    lines.append("")
    peers = {name: s for name, s in r["settings"].items() if name.startswith("llama-server")}
    ours = r["settings"].get(OURS)
    if peers and ours:
        lines += ["Sailfish against llama.cpp's server, the same prompts (token ids), greedy, the same stop strings "
                  "and threads, its prompt cache on: aggregate tokens/s of `" + OURS + "` over the best llama-server "
                  "setting's at each stream count (each counts its own completion tokens). llama-server's "
                  "greedy answers are not reproducible from run to run with its prompt cache on (its logits depend "
                  "on how a prompt was cached and batched), so its \"identical to solo\" counts differences "
                  "of its own, not errors.\n",
                  "| streams | Sailfish tokens/s | best llama-server setting | its tokens/s | ratio |", "|---|---|---|---|---|"]
        for n, x in ours["streams"].items():
            best = max(peers, key=lambda name: peers[name]["streams"].get(n, {}).get("tokens_per_s", 0.0))
            theirs = peers[best]["streams"].get(n)
            if theirs and theirs["tokens_per_s"] > 0:
                lines.append(f"| {n} | {x['tokens_per_s']:.1f} | {best} | {theirs['tokens_per_s']:.1f} | "
                             f"{x['tokens_per_s'] / theirs['tokens_per_s']:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def _speed(x: dict) -> str:
    """Aggregate tokens/s: the median of the rounds, and their range where there were several."""
    low, high = x.get("tokens_per_s_range", (x["tokens_per_s"], x["tokens_per_s"]))
    return f"{x['tokens_per_s']:.1f}" + (f" ({low:.1f}-{high:.1f})" if high > low else "")


def _carried(x: dict) -> str:
    if x.get("requests_per_forward") is None:
        return "-"
    return f"{x['requests_per_forward']:.2f} / {x['rows_per_forward']:.1f}"


def shown_command(argv: list[str]) -> str:
    """The command as the results record it: paths on this machine named by their kind (a binary's
    PATH, an index's DIR), where the results are written left out."""
    shown, args = ["python -m bench.concurrency"], iter(argv)
    for arg in args:
        flag, _, value = arg.partition("=")
        if flag in ("--llama-server", "--index", "--out"):
            value = value or next(args, "")
            if flag != "--out":
                shown += [flag, "PATH" if flag == "--llama-server" else "DIR"]
        else:
            shown.append(arg)
    return " ".join(shown)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.concurrency", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1,
                   help="timed rounds of every stream count (the counts in turn within a round): the rounds' "
                        "median tokens/s is reported with their range")
    p.add_argument("--workload", choices=["tool_calls", "agentic"], default="tool_calls")
    p.add_argument("--index", type=Path, help="the drafted settings' index directory "
                   "(default: the public corpus's, built into a temporary directory; see the docstring)")
    p.add_argument("--warmup-streams", type=int, default=None,
                   help="one untimed phase of this many streams before the timed ones (default: the most in --streams; 0: none)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="a llama-server binary (llama.cpp's own server; build it from llama-cpp-python's vendored "
                        "llama.cpp): adds its settings, with as many parallel slots as Sailfish's --parallel")
    p.add_argument("--llama-modes", default="plain,ngram-simple",
                   help="llama-server's drafting modes to run, comma-separated (bench.contenders.LlamaServer.MODES)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    llama_modes = [m for m in args.llama_modes.split(",") if m] if args.llama_server else []
    if llama_modes:
        from bench.contenders import LlamaServer

        unknown = [m for m in llama_modes if m not in LlamaServer.MODES]
        if unknown:
            p.error(f"--llama-modes: unknown {', '.join(unknown)} (known: {', '.join(LlamaServer.MODES)})")
    warmup = max(args.streams) if args.warmup_streams is None else args.warmup_streams
    from bench.workloads import agentic_requests, tool_call_requests

    requests = (tool_call_requests if args.workload == "tool_calls" else agentic_requests)(args.requests)
    # The online overlay is off: every phase repeats the same requests, and a drafter that had learnt
    # their answers in an earlier phase would make the later phases look faster.
    results = {**run_header(),
               "command": shown_command(sys.argv[1:] if argv is None else argv),
               "requests": len(requests), "workload": args.workload, "max_tokens": args.max_tokens,
               "warmup_streams": warmup, "rounds": args.rounds, "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        index_dir = args.index
        if index_dir is None:
            index_dir = Path(tmp) / "index"
            print("  building the public corpus's index", file=sys.stderr)
            results["index"] = {"source": "public corpus (BFCL v4 minus its held-out split)", **build_public_index(index_dir)}
        else:
            results["index"] = {"source": str(index_dir)}
        pinned = ["--index", str(index_dir)]
        settings = {OURS: ["--parallel", str(PARALLEL), "--overlay-tokens", "0", *pinned],
                    f"plain, --parallel {PARALLEL}": ["--parallel", str(PARALLEL), "--no-draft"],
                    "drafted, --parallel 1 (one at a time)": ["--parallel", "1", "--overlay-tokens", "0", *pinned]}
        for name, extra in settings.items():
            print(f"  {name}", file=sys.stderr)
            results["settings"][name] = run_setting(extra, requests, args.streams, args.max_tokens,
                                                    Path(tmp) / "server.log", warmup, args.rounds)
        # each mode with as many slots as Sailfish's lanes, then its first mode with one slot (one
        # request at a time, as Sailfish's --parallel 1 setting)
        for mode, slots in [(mode, PARALLEL) for mode in llama_modes] + [(m, 1) for m in llama_modes[:1]]:
            name = f"llama-server {mode}, -np {slots}" + (" (one at a time)" if slots == 1 else "")
            print(f"  {name}", file=sys.stderr)
            results["settings"][name] = run_llama_setting(args.llama_server, mode, slots, requests, args.streams,
                                                          args.max_tokens, warmup, args.rounds)
    md = markdown(results)
    write_results(args.out, "concurrency", results, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
