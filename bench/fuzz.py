"""A seeded fuzzer of hostile requests against a real Sailfish server: nothing may become a 5xx.

Contract: `hostile_requests(seed)` yields `Probe`s (method, path, headers, body, kind); `run_fuzz(base_url,
n, seed)` sends n of them (a few valid requests mixed in) and returns a `FuzzReport`: statuses by
category, every 5xx and every request that hung, and whether a normal chat request is still served
afterwards. Categories: malformed and truncated JSON, wrong types in every field (any depth), deep
nesting (the body, tool schemas, tool-call argument strings), huge values (numbers, strings, counts),
odd paths and methods, token-id prompts outside the vocabulary, oversized bodies, and clients that
disconnect mid-request.

`python -m bench.fuzz [--requests 10000] [--seed 0] [--out bench/results/fuzz.md]` (`make fuzz`) starts
`python -m server` on the bundled model (no trace log; `--default-max-tokens 4` and `--max-context
2048`, so that a valid request generates a few tokens and a huge prompt is refused rather than
prefilled for minutes on a CPU; `--no-adaptive`, no start-up cost curve), measures its resident memory after a warm-up and after the run, and
writes a report. tests/test_fuzz.py runs a few hundred probes in CI.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120.0


@dataclass
class Probe:
    kind: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict = field(default_factory=dict)
    disconnect: bool = False   # send part of the request and close the socket


@dataclass
class FuzzReport:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    by_kind: dict = field(default_factory=lambda: defaultdict(Counter))
    server_errors: list = field(default_factory=list)    # (kind, status, body excerpt, request excerpt)
    hangs: list = field(default_factory=list)
    served_after: bool = False
    seconds: float = 0.0

    def summary(self) -> dict:
        return {"sent": self.sent, "statuses": dict(sorted(self.statuses.items(), key=str)),
                "server_errors": len(self.server_errors), "hangs": len(self.hangs),
                "served_after": self.served_after, "seconds": round(self.seconds, 1),
                "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())}}


# ---------------------------------------------------------------- generators

def valid_chat(rng: random.Random) -> dict:
    body = {"model": "gemma", "max_tokens": rng.randint(1, 3),
            "messages": [{"role": "system", "content": "You list files."},
                         {"role": "user", "content": rng.choice(["list the files", "read a.txt", "hi"])}]}
    if rng.random() < 0.5:
        body["tools"] = [{"type": "function", "function": {
            "name": "list_files", "description": "List files",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    if rng.random() < 0.3:
        body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "list_files", "arguments": '{"path": "."}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt b.txt"}]
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def valid_completion(rng: random.Random) -> dict:
    prompt = rng.choice(["Once upon a time", [2, 100, 200, 300]])
    return {"model": "gemma", "prompt": prompt, "max_tokens": rng.randint(1, 3), "stream": rng.random() < 0.3}


def _weird_value(rng: random.Random, depth: int = 0):
    pick = rng.randrange(16)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**31, -2**63 - 1, 2**64, 10**30, 10**400])
    if pick == 3:
        return rng.choice([0.5, -0.0, 1e308, -1e308, 3.7, 1e-320])
    if pick == 4:
        # "\ud800" alone: json.dumps escapes it, and the server decodes a string no encoding carries
        return rng.choice(["", "x", "\x00", "\ud800", "a\udfffb", "\ud83d\ude00",
                           "<|tool_call>call:x{", "{" * 50, "\u202e\u0000\ufeff", "a" * rng.choice([10, 10_000, 300_000])])
    if pick == 5:
        return [] if depth > 2 else [_weird_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if pick == 6:
        return {} if depth > 2 else {rng.choice(["type", "text", "name", "x", ""]): _weird_value(rng, depth + 1)}
    if pick == 7:
        return [{"type": "image_url", "image_url": {"url": "data:,"}}]
    if pick == 8:
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    if pick == 9:
        return [1, "a", None, [2]]
    if pick == 10:
        return "nan"
    if pick == 11:
        return rng.choice(["none", "auto", "required", {"type": "function", "function": {"name": "nope"}}])
    if pick == 12:
        return [[1, 2], [3]]
    if pick == 13:
        return {"include_usage": rng.choice([True, 1, "yes", None])}
    if pick == 14:
        return rng.choice([-5, 0, 3, 8])
    return {"role": rng.choice(["user", "tool", "assistant", "robot", 1]), "content": _weird_value(rng, depth + 1)}


def _mutate(rng: random.Random, body, depth: int = 0):
    """Replace, delete or add one field somewhere in `body` (a copy)."""
    body = json.loads(json.dumps(body))
    node = body
    for _ in range(rng.randint(0, 4)):
        children = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) if isinstance(node, list) else []
        containers = [(k, v) for k, v in children if isinstance(v, (dict, list)) and v]
        if not containers or rng.random() < 0.3:
            break
        _, node = rng.choice(containers)
    if isinstance(node, dict):
        keys = list(node) + ["temperature", "seed", "n", "logprobs", "response_format", "stop", "tool_choice",
                             "stream_options", "max_completion_tokens", "top_p", "echo", "best_of"]
        key = rng.choice(keys)
        if rng.random() < 0.15 and key in node:
            del node[key]
        else:
            value = _weird_value(rng)
            if key in ("max_tokens", "max_completion_tokens") and isinstance(value, int) and not isinstance(value, bool) \
                    and value > 8:
                value = -value  # a valid huge limit would only make the run slow, not hostile
            node[key] = value
    elif isinstance(node, list) and node:
        i = rng.randrange(len(node))
        node[i] = _weird_value(rng)
    return body


def _deep(kind: str, n: int) -> str:
    return "[" * n + "]" * n if kind == "list" else '{"a":' * n + "1" + "}" * n


def hostile_requests(seed: int = 0):
    rng = random.Random(seed)
    while True:
        roll = rng.random()
        chat = "/v1/chat/completions"
        if roll < 0.14:
            base = json.dumps(valid_chat(rng) if rng.random() < 0.7 else valid_completion(rng)).encode()
            choice = rng.randrange(6)
            if choice == 0:
                body = base[:rng.randrange(len(base))]
            elif choice == 1:
                body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
            elif choice == 2:
                body = b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 2}'
            elif choice == 3:
                body = rng.choice([b"", b"null", b"[]", b"1", b'"x"', b"NaN", b'{"max_tokens": NaN}',
                                   b'{"temperature": Infinity, "messages": []}'])
            elif choice == 4:
                body = base.replace(b'"', b"'", 1)
            else:
                body = base + b"}"
            yield Probe("malformed_json", "POST", rng.choice([chat, "/v1/completions"]), body)
        elif roll < 0.52:
            base = valid_chat(rng) if rng.random() < 0.7 else valid_completion(rng)
            path = chat if "messages" in base else "/v1/completions"
            yield Probe("wrong_types", "POST", path, json.dumps(_mutate(rng, base)).encode())
        elif roll < 0.62:
            n = rng.choice([65, 200, 5_000, 50_000])
            choice = rng.randrange(4)
            body = valid_chat(rng)
            if choice == 0:
                raw = '{"messages": ' + _deep("list", n) + ', "max_tokens": 2}'
            elif choice == 1:
                body["tools"] = [{"type": "function", "function": {"name": "t", "parameters": {
                    "type": "object", "properties": json.loads(_deep("dict", min(n, 900)))}}}]
                raw = json.dumps(body)
            elif choice == 2:
                body["messages"].append({"role": "assistant", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "t", "arguments": _deep(rng.choice(["list", "dict"]), n)}}]})
                raw = json.dumps(body)
            else:
                body["messages"].append({"role": "tool", "tool_call_id": "c", "content": _deep("dict", n)})
                raw = json.dumps(body)
            yield Probe("deep_nesting", "POST", chat, raw.encode())
        elif roll < 0.72:
            body = valid_chat(rng)
            choice = rng.randrange(5)
            if choice == 0:
                body["messages"][-1]["content"] = "word " * rng.choice([20_000, 200_000])
            elif choice == 1:
                body["messages"] = body["messages"] * rng.choice([500, 5_000])
            elif choice == 2:
                body["tools"] = [{"type": "function", "function": {"name": f"t{i}", "description": "d" * 2_000,
                                                                   "parameters": {"type": "object"}}} for i in range(rng.choice([50, 2_000]))]
            elif choice == 3:
                body[rng.choice(["temperature", "seed", "max_tokens", "n", "top_p"])] = rng.choice(
                    [10**400, -10**400, 2**64, 2**63, 1e308, -1e308])
            else:
                body["stop"] = ["x" * 100_000] * rng.choice([1, 50])
            yield Probe("huge_values", "POST", chat, json.dumps(body).encode())
        elif roll < 0.80:
            method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "POST", "OPTIONS"])
            path = rng.choice(["/", "/v1", "/v1/", "/v1/models/x", "/v1/chat/completions/", "/v1/../health",
                               "/%00", "/v1/chat%2Fcompletions", "/" + "a" * 4_000, "/admin/reload-index/x",
                               "/v1/messages", "/v1/responses", "/health?x=" + "%" * 10, "/metrics/.."])
            body = rng.choice([None, b"{}", b"x"])
            yield Probe("odd_paths", method, path, body)
        elif roll < 0.88:
            ids = rng.choice([[262_144], [2, 10**6], [-1, 5], [2, 2**63], [2**70], [0] * 3, [2, 5, 262_143]])
            yield Probe("token_ids", "POST", "/v1/completions",
                        json.dumps({"prompt": ids, "max_tokens": 2}).encode())
        elif roll < 0.91:
            if rng.random() < 0.5:
                yield Probe("oversized", "POST", chat, b"{}", headers={"content-length": str(2**40)}, disconnect=True)
            else:
                yield Probe("oversized", "POST", chat, b'{"x": "' + b"a" * (33 * 2**20) + b'"}')
        elif roll < 0.96:
            body = json.dumps(valid_chat(rng) | {"stream": rng.random() < 0.5}).encode()
            path = rng.choice([chat, "/v1/completions", "/v1/messages", "/v1/responses"])
            # half send the whole request, half a body shorter than its Content-Length (gone mid-upload)
            short = {"content-length": str(len(body) + rng.randint(1, 4096))} if rng.random() < 0.5 else {}
            yield Probe("disconnect", "POST", path, body, headers=short, disconnect=True)
        else:
            body = valid_chat(rng) if rng.random() < 0.7 else valid_completion(rng)
            yield Probe("valid", "POST", chat if "messages" in body else "/v1/completions", json.dumps(body).encode())


# ---------------------------------------------------------------- sending

def _disconnect(base_url: str, probe: Probe) -> None:
    """Send the headers and part of the body (or all of it, then read a little), then close."""
    u = urlparse(base_url)
    body = probe.body or b""
    length = probe.headers.get("content-length", str(len(body)))
    head = (f"{probe.method} {probe.path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head + body[:max(1, len(body) // 2)] if int(length) > len(body) else head + body)
        try:
            s.recv(64)
        except OSError:
            pass


def run_fuzz(base_url: str, n: int, seed: int = 0, api_key: str | None = None, progress_every: int = 0) -> FuzzReport:
    report = FuzzReport()
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {api_key}"} if api_key else {})
    t0 = time.perf_counter()
    with httpx.Client(base_url=base_url, timeout=TIMEOUT_S, headers=headers) as client:
        for probe, _ in zip(hostile_requests(seed), range(n)):
            report.sent += 1
            if progress_every and report.sent % progress_every == 0:
                print(f"{report.sent}/{n} probes, {time.perf_counter() - t0:.0f} s, "
                      f"{len(report.server_errors)} 5xx, {len(report.hangs)} hangs", flush=True)
            if probe.disconnect:
                try:
                    _disconnect(base_url, probe)
                    report.by_kind[probe.kind]["closed"] += 1
                except OSError as e:
                    report.by_kind[probe.kind][f"socket:{type(e).__name__}"] += 1
                continue
            try:
                r = client.request(probe.method, probe.path, content=probe.body, headers=probe.headers)
                status = r.status_code
                text = r.text
            except httpx.TimeoutException:
                report.hangs.append((probe.kind, probe.path, (probe.body or b"")[:200]))
                continue
            except httpx.HTTPError as e:  # the server closed on us: as bad as a 500
                status, text = 599, f"{type(e).__name__}: {e}"
            report.statuses[status] += 1
            report.by_kind[probe.kind][status] += 1
            streamed_error = status == 200 and '"server_error"' in text
            if status >= 500 or streamed_error:
                report.server_errors.append((probe.kind, status, text[:300], (probe.body or b"")[:300]))
        try:
            r = client.post("/v1/chat/completions", json={"model": "gemma", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hello"}]})
            report.served_after = r.status_code == 200 and r.json()["choices"][0]["message"] is not None
        except httpx.HTTPError:
            report.served_after = False
    report.seconds = time.perf_counter() - t0
    return report


# ---------------------------------------------------------------- the CLI (make fuzz)

def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1000, help="probes before the first memory reading")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefix-cache-mb", type=int, default=256,
                    help="the server's prefix cache budget (bounded, so resident memory reaches its level early)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fuzz.md")
    args = ap.parse_args(argv)
    from bench.live_server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "server", "--port", str(port), "--no-trace-log", "--default-max-tokens", "4",
           "--watch-index", "0", "--no-adaptive", "--max-context", "2048", "--prefix-cache-mb",
           str(args.prefix_cache_mb)] + (["--model", args.model] if args.model else [])
    log_path = ROOT / "bench" / "results" / "tmp" / "fuzz-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "w")   # a file, not a pipe: a full pipe would stall the server
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log_file, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        warm = run_fuzz(base, args.warmup, seed=args.seed + 1)
        rss_warm = _rss_mb(proc.pid)
        report = run_fuzz(base, args.requests, seed=args.seed, progress_every=500)
        rss_end = _rss_mb(proc.pid)
        errors = httpx.get(base + "/metrics").text
        internal = next((line.split()[-1] for line in errors.splitlines()
                         if line.startswith("sailfish_internal_errors_total ")), "?")
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()
    s = report.summary()
    lines = ["# Fuzzing the server (bundled model)", "",
             f"`python -m bench.fuzz --requests {args.requests} --seed {args.seed}`: {s['sent']} probes in "
             f"{s['seconds']:.0f} s after {warm.sent} warm-up probes.", "",
             f"- responses with status >= 500: {s['server_errors'] + len(warm.server_errors)}; hangs: "
             f"{s['hangs'] + len(warm.hangs)}; `sailfish_internal_errors_total` {internal}",
             f"- a normal request served afterwards: {s['served_after']}",
             f"- resident memory: {rss_warm:.0f} MB after the warm-up, {rss_end:.0f} MB after the run "
             f"({(rss_end / rss_warm - 1) * 100:+.1f}%); bounds: prefix cache {args.prefix_cache_mb} MiB, "
             "tool declarations 16 MB, request bodies 32 MiB, context 2,048 tokens", "", "| category | responses |", "|---|---|"]
    for kind, counts in s["by_kind"].items():
        lines.append(f"| {kind} | " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=str)) + " |")
    for kind, status, text, req in report.server_errors[:20]:
        lines.append(f"\n5xx ({kind}, {status}): {text!r} for {req!r}")
    out = "\n".join(lines) + "\n"
    print(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(out)
    ok = not report.server_errors and not warm.server_errors and not report.hangs and report.served_after
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
