"""Server-side tokens/s with and without drafting, on held-out BFCL tool-call requests.

`python -m bench.server_bench [--requests 8] [--max-tokens 64] [--model M] [--index DIR]` starts
`python -m server` twice side by side (drafted, and `--no-draft`) and sends both the same chat
requests: the first assistant turn of held-out BFCL v4 conversations (`bfcl_split` with the
constants in common.paths, so the default index never saw them), one at a time, in alternating
order, after one unmeasured warm-up. It reports the server's own decode speed per request
(`usage.sailfish`: tokens after the first per decode second; prefill and HTTP excluded) as median
and spread, and whether every output is identical both ways. On the bundled base model the
speed-up is inflated: it echoes and loops, which any n-gram drafter predicts well.
"""
from __future__ import annotations

from bench.live_server import free_port

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def holdout_requests(n: int, categories: list[str]) -> list[dict]:
    from index.bfcl import iter_bfcl_conversations, bfcl_split
    from common.paths import BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED

    _, hold = bfcl_split(iter_bfcl_conversations(categories), BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED)
    out = []
    for conv in hold:
        first = next((i for i, m in enumerate(conv.messages) if m["role"] == "assistant"), None)
        if first:
            out.append({"id": conv.key(), "messages": conv.messages[:first], "tools": conv.tools})
        if len(out) == n:
            break
    return out


def start_server(extra: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--port", str(port), "--no-trace-log", *extra]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log_path.read_text()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError("server did not start in 10 minutes")
        time.sleep(0.5)


def send(client: httpx.Client, req: dict, max_tokens: int) -> dict:
    body = {"model": "bench", "messages": req["messages"], "tools": req["tools"], "max_tokens": max_tokens}
    r = client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    data = r.json()
    return {"id": req["id"], "message": data["choices"][0]["message"],
            "finish_reason": data["choices"][0]["finish_reason"], "usage": data["usage"]}


def run_both(extra: list[str], requests: list[dict], max_tokens: int, log_dir: Path) -> tuple[list, list]:
    """Both servers run side by side; each request goes to both, one at a time, in alternating order,
    so that both modes see the same background load (this machine is shared)."""
    procs = []
    try:
        for name, flags in (("drafted", extra), ("plain", extra + ["--no-draft"])):
            procs.append(start_server(flags, log_dir / f"server-{name}.log"))
        clients = [httpx.Client(base_url=base, timeout=600) for _, base in procs]
        for c in clients:
            send(c, requests[0], max_tokens)  # warm-up, not measured
        results: tuple[list, list] = ([], [])
        for i, req in enumerate(requests):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                results[k].append(send(clients[k], req, max_tokens))
        return results
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(timeout=60)


def summarize(name: str, results: list[dict]) -> dict:
    speeds = [r["usage"]["sailfish"]["decode_tokens_per_s"] for r in results]
    decode_s = sum(r["usage"]["sailfish"]["decode_s"] for r in results)
    tokens = sum(max(r["usage"]["completion_tokens"] - 1, 0) for r in results)
    drafted = sum(r["usage"]["sailfish"]["drafted_tokens"] for r in results)
    accepted = sum(r["usage"]["sailfish"]["accepted_tokens"] for r in results)
    q = statistics.quantiles(speeds, n=4) if len(speeds) >= 2 else [speeds[0]] * 3
    return {"mode": name, "requests": len(results), "median_tok_s": round(statistics.median(speeds), 2),
            "p25_tok_s": round(q[0], 2), "p75_tok_s": round(q[2], 2),
            "min_tok_s": round(min(speeds), 2), "max_tok_s": round(max(speeds), 2),
            "aggregate_tok_s": round(tokens / decode_s, 2) if decode_s else 0.0,
            "completion_tokens": sum(r["usage"]["completion_tokens"] for r in results),
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.server_bench", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=8, help="held-out BFCL requests (default 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--categories", nargs="+", default=["simple_python", "multiple", "parallel"])
    p.add_argument("--model", help="passed to the server (default: the bundled Gemma 3 270M)")
    p.add_argument("--index", help="passed to the server (default: the default index)")
    p.add_argument("--out", type=Path, help="write the summary and per-request results as JSON")
    args = p.parse_args(argv)

    requests = holdout_requests(args.requests, args.categories)
    if not requests:
        print("no held-out BFCL requests found (is bfcl-eval installed?)", file=sys.stderr)
        return 2
    extra = (["--model", args.model] if args.model else []) + (["--index", args.index] if args.index else [])
    with tempfile.TemporaryDirectory(prefix="sailfish-bench-") as tmp:
        drafted, plain = run_both(extra, requests, args.max_tokens, Path(tmp))
        startup = (Path(tmp) / "server-drafted.log").read_text()
    same = [a["message"] == b["message"] and a["finish_reason"] == b["finish_reason"]
            for a, b in zip(drafted, plain)]
    summary = [summarize("drafted", drafted), summarize("no-draft", plain)]
    print(f"{len(requests)} held-out BFCL requests ({', '.join(args.categories)}), max_tokens {args.max_tokens}")
    for line in startup.splitlines():
        if "drafting:" in line or "model " in line:
            print("  server:", line.split(": ", 1)[-1][:200])
    for s in summary:
        print(f"{s['mode']:>9}: median {s['median_tok_s']:7.2f} tok/s (IQR {s['p25_tok_s']:.2f}-{s['p75_tok_s']:.2f}, "
              f"range {s['min_tok_s']:.2f}-{s['max_tok_s']:.2f}), aggregate {s['aggregate_tok_s']:.2f} tok/s, "
              f"{s['completion_tokens']} tokens, accepted {s['accepted_tokens']}/{s['drafted_tokens']} drafted")
    ratio = summary[0]["median_tok_s"] / summary[1]["median_tok_s"] if summary[1]["median_tok_s"] else float("nan")
    print(f"speed-up (median): x{ratio:.2f}; identical outputs: {sum(same)}/{len(same)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "identical": same, "drafted": drafted,
                                        "no_draft": plain}, indent=1))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
