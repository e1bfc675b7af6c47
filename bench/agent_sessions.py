"""Whole multi-turn agent sessions replayed through the server, as an agent client sends them.

`python -m bench.agent_sessions [--sessions 3] [--max-turns 10] [--max-context TOKENS] [--min-turns 10]
[--max-tokens 64] [--claude-sessions 2] [--probes 4] [--probe-prompt 4000] [--probe-added 200] [--threads N]
[--contenders baseline,cache,cache+draft] [--model M] [--index DIR] [--port-base P] [--claude-samples DIR]
[--interleave session|turn] [--out bench/results/agent_sessions.md] [--quick] [--dry-run]`

The bars it checks (the issue's, on the CPU): session wall time with cache and drafting at least 5x
faster than with `--no-prefix-cache --no-draft`, on conversations of 10 or more turns that grow to
6k tokens; and the TTFT of a turn that adds 200 tokens to a cached 4k conversation at most 15% of a
fresh prefill's.

Where the sessions come from. Only real recorded conversations, never generated text:
- BFCL v4 multi-turn, HELD-OUT split (index.bfcl.bfcl_split with the constants in common.paths, so
  the default index never saw these conversations; but see the caveats). No recorded BFCL
  conversation is long enough for the bar: they have at most 7 assistant turns and grow 0.1k-0.8k
  tokens past their tool declarations (2.2k-5.2k tokens). So the long sessions are CHAINED
  (bench.sessions.chain_conversations): an agent working through several tasks in one conversation.
  Held-out conversations that offer the same tool list (identical `tools`: the same involved
  classes, the same excluded functions) are appended one after another, conversation B's messages
  after A's, unchanged, under the one tool list (BFCL multi-turn has no system message; its tool
  results are not in the data, so none are invented: the next user request follows the calls, as in
  BFCL itself). Groups go largest first, members by question number; a chain closes once its last
  recorded prompt reaches `--max-context` tokens or it has `--max-turns` assistant turns. Every BFCL
  question number is used at most once over all chains (one of its four category variants), and no
  two selected sessions share one.
- The Claude Code sample transcripts in `<repo>/../shared/data/claude-code-samples/*.jsonl` (read by
  index.traces' Claude Code reader; they are NOT among the default index's sources, see
  common.paths.default_trace_paths, unless a user copied them there). These are real single sessions
  and are replayed as recorded; on the CPU none has 10 turns under 6000 tokens (tool_heavy.jsonl:
  4 turns, 0.2k -> 1.6k; subagent.jsonl: 12 turns, but past 6000 tokens at its third), so the
  `--claude-sessions` longest ones with fewer than `--min-turns` turns (at least 2) are replayed too and
  reported apart from the bar's sessions.
At every recorded assistant message i the client sends `messages[:i]` (the conversation so far, the
recorded replies, not the model's, with its tools) as a streamed chat completion, temperature 0,
`max_tokens = min(tokens of the recorded reply, --max-tokens)`; token counts come from the bundled
model's tokenizer (common.tokenizer, the server's own tokenizer and chat format for the bundled model;
for `--model DIR` that directory's tokenizer; other `--model` forms keep the bundled one, so budgets
are then approximate) and the server's own `usage.prompt_tokens` is reported beside them. A session
stops after `--max-turns` turns or before the first prompt longer than `--max-context` tokens; the
bar's sessions are the `--sessions` ones with at least `--min-turns` turns (`--dry-run` lists what exists).

The TTFT bar's turns (`--probes`, bench.sessions.plan_probes): from chained sessions that are NOT
replayed (so nothing of the measured prompt past the cached conversation was sent before), the pair of
consecutive recorded turns (a, b) with prompt(a) nearest `--probe-prompt` tokens (within 15%) and
prompt(b) - prompt(a) nearest `--probe-added` tokens (0.5x-1.6x), at most one per session, no two
sharing a BFCL question. Each contender with the prefix cache gets turn a (the conversation so far,
which the cache then holds, as after an agent's previous turn), then turn b, timed; the contender
without it (`baseline`) gets turn b alone, which is a fresh prefill of the same prompt. The ratio is
per probe, server-side TTFT (`usage.sailfish.queue_s + prefill_s`) of b over baseline's, with the
tokens the cache actually reused (`prompt_tokens_details.cached_tokens`) beside it; server-side,
because the server streams a tool call only once it is complete, so a client sees a reply that starts
with a call only at its end (client-side TTFT is reported too).

Contenders, each its own `python -m server --no-trace-log` process, all started once, one after
another (so the cost-curve measurement at start-up is not disturbed), and given two unmeasured
warm-up requests (a short prompt and one of ~500 tokens, sharing nothing with the sessions):
  baseline     --no-prefix-cache --no-draft  (no KV reuse across requests, plain greedy decoding)
  cache        --no-draft                    (prefix cache on)
  cache+draft  default flags                 (prefix cache and n-gram drafting)
Every session is replayed through every contender, one request at a time; the contenders' order
rotates from session to session (and from probe to probe), so that slow phases of a shared machine hit
each alike (`--interleave turn`: every turn goes to each contender before the next turn, the order
rotating per turn; each server has its own cache, so what it sees is the same). Per contender:
client-side TTFT per turn (time to the first chunk with content or a tool-call delta; the whole
response time when nothing was generated) and server-side TTFT (queue + prefill), as median and
p10-p90 over all turns and over each session's last 3 turns (the longest contexts); decode tokens/s
(`usage.sailfish.decode_tokens_per_s`, median); prompt and cached tokens
(`usage.prompt_tokens_details.cached_tokens`, missing = 0, and `usage.sailfish.cached_tokens`);
each session's wall time (sum of the client's turn times) and the speed-up over baseline's
(baseline wall / contender wall, same session), median and range over the bar's sessions and, apart,
over the Claude Code ones; whether every reply (text + tool calls) is identical across contenders,
turn by turn and probe by probe; each server's peak RSS and the prefix cache's peak against its
budget (/health `prefix_cache`, `sailfish_prefix_cache*` lines of /metrics) after the run. Writes
the markdown report to `--out` (default bench/results/agent_sessions.md), the raw per-turn numbers
beside it (.json) and, when matplotlib is importable, a chart (.png: server-side TTFT per turn against
prompt tokens, and session wall times). Exit status 0 when every reply is identical and no request
failed, 1 otherwise, 2 when nothing could run.

Defaults. `--max-context` is 6000 tokens on a CPU-only machine and 20000 when CUDA is available. On
the CPU the default replays the 3 chained BFCL sessions with 10 turns that end nearest 6000 tokens
(4.6k -> 6.0k, 4.75k -> 5.9k and 4.6k -> 5.65k prompt tokens, 2-4 conversations each; most of each
prompt is the tool declarations every turn repeats), Claude Code's tool_heavy.jsonl (4 turns, 0.2k ->
1.6k) and subagent.jsonl (2 turns, 2.8k -> 5.4k), and 4 probes of ~200 tokens on 3.6k-4.3k-token
conversations; about 28 minutes on a 2-core CPU with the bundled fp32 model, one thread per server
(baseline's full prefills of 4.6-6k tokens, ~25 s each, dominate). `--quick`: 2 sessions of 4 turns under 3000 tokens,
replies capped at 32 tokens, one probe of ~200 tokens on ~2.5k, no extra Claude Code session.

Threads. Every server gets the same intra-op thread count (`--threads`, set as OMP_NUM_THREADS and
MKL_NUM_THREADS; default half the cores, at least 1, on a CPU-only machine). With torch's default
(a thread per core) on a 2-core machine that other processes also load, the `--no-draft` servers ran
6-8x slower per forward (a 300-token prefill 11 s instead of 1.3 s, a decode step 0.48 s instead of
0.08 s) than the default server, which measures its verify cost curve at start-up (taking 110 s
instead of 6 s, and measuring a curve distorted by the same stalls); with one thread each, all three
run the same forward in the same time. Unpinned, the speed-ups measured would be mostly that artefact.

Caveats. The bundled model is Gemma 3 270M, a BASE model: its replies echo and loop, which any
n-gram drafter predicts well, so cache+draft's decode speed-up on it is inflated; the prefix cache's
gain (prefill skipped for the shared prefix) does not depend on what the model says. Every held-out
BFCL multi-turn question has a sibling variant (the same numbered question in another multi_turn
category) in the index split (bfcl_split hashes conversation ids, not question numbers), so drafting
on BFCL sessions is inflated further; the Claude Code samples have no such sibling. The chained
sessions are real conversations put end to end, not one recorded session: each BFCL task starts
from its own environment state, which the messages do not show. Sessions with the same tool list
share the prompt's first thousands of tokens (the tool declarations): a later one finds them in the
cache an earlier one left, as an agent's next session would. Requests carry the recorded history,
not the model's replies, exactly as a client resending a transcript would. The `baseline` contender
needs the server's `--no-prefix-cache` flag; without it the bench stops and says so
(`--contenders cache,cache+draft` runs meanwhile, without the ratios).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import httpx

from bench.live_server import free_port
from bench.results import run_header
from bench.sessions import (BFCL_MULTI_TURN, DEFAULT_CLAUDE_SAMPLES, ROOT, Probe, Session, Turn, build_sessions,
                            chain_conversations, last_prompt_tokens, load_conversations, plan_probes,
                            select_sessions, turn_token_counts)

CONTENDERS = {
    "baseline": ["--no-prefix-cache", "--no-draft"],
    "cache": ["--no-draft"],
    "cache+draft": [],
}
LAST_TURNS = 3
DEFAULTS = dict(sessions=3, max_turns=10, min_turns=10, max_tokens=64, max_context=None, claude_sessions=2,
                probes=4, probe_prompt=4000, probe_added=200)
QUICK = dict(sessions=2, max_turns=4, min_turns=3, max_tokens=32, max_context=3000, claude_sessions=0,
             probes=1, probe_prompt=2500, probe_added=200)
CPU_MAX_CONTEXT, CUDA_MAX_CONTEXT = 6000, 20000
DEFAULT_OUT = ROOT / "bench" / "results" / "agent_sessions.md"
# The bars: session wall speed-up of cache+draft over baseline, and the cached turn's TTFT share.
BAR_SPEEDUP, BAR_TTFT_SHARE = 5.0, 0.15


# Two unmeasured requests per server before the sessions, sharing nothing with them but the BOS token: a
# short one and one of a few hundred tokens (the drafted server has already run forwards at start-up to
# measure its cost curve; this gives every contender a comparable start).
_FILLER = " ".join(f"Item {i}: the weather report for day {i} says mild, with light wind." for i in range(24))
WARM_UP = Session("warm-up", "bench", [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": ""},
                                       {"role": "user", "content": _FILLER}, {"role": "assistant", "content": ""}],
                  [], [Turn(0, 1, 0, 4, 4), Turn(1, 3, 0, 8, 8)])


class ServerError(RuntimeError):
    pass


# ---------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: list[float]) -> dict:
    return {"n": len(values), "median": percentile(values, 0.5), "p10": percentile(values, 0.1),
            "p90": percentile(values, 0.9), "min": min(values) if values else None,
            "max": max(values) if values else None}


# ---------------------------------------------------------------- the client


def read_stream(lines: Iterable[str], clock: Callable[[], float] = time.perf_counter) -> dict:
    """SSE lines of a streamed chat completion -> the reply, its usage, and `first_delta_at`: the clock
    when the first chunk with content or a tool-call delta arrived (None when nothing was generated)."""
    content: list[str] = []
    calls: dict[int, dict] = {}
    usage, finish, first = None, None, None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise ServerError((chunk["error"] or {}).get("message", "error event in the stream"))
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if first is None and (delta.get("content") or delta.get("tool_calls")):
                first = clock()
            if delta.get("content"):
                content.append(delta["content"])
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    return {"content": "".join(content), "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": finish, "usage": usage, "first_delta_at": first}


def reply_key(record: dict) -> tuple:
    """What must be identical across contenders: the text and the calls (ids are random)."""
    return (record.get("content"), tuple((c["name"], c["arguments"]) for c in record.get("tool_calls") or ()),
            record.get("error"))


def send_turn(client: httpx.Client, session: Session, turn) -> dict:
    messages, tools = session.request(turn)
    body = {"model": "bench", "messages": messages, "max_tokens": turn.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if tools:
        body["tools"] = tools
    record = {"session": session.id, "k": turn.k, "index": turn.index, "expected_prompt_tokens": turn.prompt_tokens,
              "recorded_reply_tokens": turn.reply_tokens, "max_tokens": turn.max_tokens, "error": None}
    t0 = time.perf_counter()
    reply = {"content": "", "tool_calls": [], "finish_reason": None, "usage": None, "first_delta_at": None}
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise ServerError(f"HTTP {r.status_code}: {r.text[:300]}")
            reply = read_stream(r.iter_lines())
    except (ServerError, httpx.HTTPError, ValueError) as e:
        record["error"] = str(e)
    t1 = time.perf_counter()
    record.update({
        "wall_s": t1 - t0,
        "ttft_s": (reply["first_delta_at"] - t0) if reply["first_delta_at"] is not None else t1 - t0,
        "generated_anything": reply["first_delta_at"] is not None,
        "content": reply["content"], "tool_calls": reply["tool_calls"], "finish_reason": reply["finish_reason"],
        **usage_numbers(reply["usage"]),
    })
    return record


def usage_numbers(usage: dict | None) -> dict:
    """The numbers a record keeps from a response's usage. Server-side TTFT = queue_s + prefill_s (None
    when the server reports neither); missing cached_tokens count as 0."""
    usage = usage or {}
    sf = usage.get("sailfish") or {}
    queue, prefill = sf.get("queue_s"), sf.get("prefill_s")
    return {
        "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        "sailfish_cached_tokens": sf.get("cached_tokens"),
        "decode_tokens_per_s": sf.get("decode_tokens_per_s"), "prefill_s": prefill, "queue_s": queue,
        "server_ttft_s": None if queue is None and prefill is None else (queue or 0.0) + (prefill or 0.0),
        "decode_s": sf.get("decode_s"), "drafted_tokens": sf.get("drafted_tokens"),
        "accepted_tokens": sf.get("accepted_tokens"), "usage": usage or None,
    }


# ---------------------------------------------------------------- the servers


@dataclass
class Server:
    name: str
    flags: list[str]
    proc: subprocess.Popen
    base: str
    log_path: Path
    startup_s: float


def server_flags() -> str:
    """`python -m server --help`, to check for flags before starting anything."""
    out = subprocess.run([sys.executable, "-m", "server", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    return out.stdout + out.stderr


def missing_flags(contenders: list[str], help_text: str) -> list[str]:
    needed = {f for name in contenders for f in CONTENDERS[name]}
    return sorted(f for f in needed if f not in help_text)


def thread_env(threads: int) -> dict[str, str]:
    """The environment that pins a server's intra-op (OpenMP / MKL) threads; {} for 0 (torch's default)."""
    return {} if not threads else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def start_server(name: str, flags: list[str], port: int, log_path: Path, timeout_s: float = 900,
                 env: dict[str, str] | None = None) -> Server:
    cmd = [sys.executable, "-m", "server", "--port", str(port), "--no-trace-log", *flags]
    t0 = time.monotonic()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, **env} if env else None)
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server {name} exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return Server(name, flags, proc, base, log_path, time.monotonic() - t0)
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            stop_server(proc)
            raise RuntimeError(f"server {name} did not answer /health within {timeout_s:.0f} s")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM of a live process (Linux); None elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def prefix_fields(health: dict) -> dict:
    """Every /health field whose name mentions the prefix cache, at any depth."""
    out = {}
    for key, value in (health or {}).items():
        if "prefix" in key.lower():
            out[key] = value
        elif isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in prefix_fields(value).items()})
    return out


def prefix_metrics(text: str) -> dict:
    """Every sample line of the Prometheus text that starts with `sailfish_prefix_cache`."""
    out = {}
    for line in text.splitlines():
        if line.startswith("sailfish_prefix_cache"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                out[name] = value
    return out


def server_state(server: Server) -> dict:
    state = {"flags": server.flags, "startup_s": round(server.startup_s, 1),
             "peak_rss_bytes": peak_rss_bytes(server.proc.pid)}
    try:
        health = httpx.get(server.base + "/health", timeout=30).json()
        state["health"] = health
        state["drafting"] = health.get("drafting")
        state["prefix_cache_health"] = prefix_fields(health)
    except (httpx.HTTPError, ValueError) as e:
        state["health_error"] = str(e)
    try:
        state["prefix_cache_metrics"] = prefix_metrics(httpx.get(server.base + "/metrics", timeout=30).text)
    except httpx.HTTPError as e:
        state["metrics_error"] = str(e)
    lines = server.log_path.read_text(errors="replace").splitlines()
    state["log_head"] = [line.split(": ", 1)[-1][:240] for line in lines
                         if any(w in line for w in ("model ", "drafting:", "engine:", "context limit", "prefix"))][:12]
    state["log_problems"] = [line[:300] for line in lines
                             if any(w in line for w in ("Traceback", "ERROR", "Error", " 500 "))][:20]
    return state


def prefix_cache_use(state: dict) -> dict | None:
    """Peak and budget of a server's prefix cache, from /health (else /metrics); None when it is off."""
    pc = (state.get("health") or {}).get("prefix_cache")
    if isinstance(pc, dict) and "budget_bytes" in pc:
        return {k: pc.get(k) for k in ("budget_bytes", "peak_bytes", "bytes", "entries", "evictions", "hits",
                                       "requests", "reused_tokens", "computed_tokens")}
    m = state.get("prefix_cache_metrics") or {}
    if "sailfish_prefix_cache_budget_bytes" in m:
        return {"budget_bytes": m["sailfish_prefix_cache_budget_bytes"],
                "peak_bytes": m.get("sailfish_prefix_cache_peak_bytes"), "bytes": m.get("sailfish_prefix_cache_bytes"),
                "entries": m.get("sailfish_prefix_cache_entries"), "evictions": m.get("sailfish_prefix_cache_evictions")}
    return None


def rotation(names: list[str], s: int) -> list[str]:
    """Session s runs the contenders in this order: rotated by one per session."""
    k = s % len(names)
    return names[k:] + names[:k]


def _clients(servers: dict[str, Server]) -> dict[str, httpx.Client]:
    return {name: httpx.Client(base_url=srv.base, timeout=httpx.Timeout(900, connect=30))
            for name, srv in servers.items()}


def replay(servers: dict[str, Server], sessions: list[Session], interleave: str = "session",
           log=print) -> dict[str, list[dict]]:
    """Every session through every server, one request at a time. interleave "session": each server
    replays the whole session in turn, the order rotated per session; "turn": each turn goes to every
    server before the next turn, the order rotated per turn (each server keeps its own cache, so the
    requests it sees are the same either way)."""
    names = list(servers)
    records: dict[str, list[dict]] = {name: [] for name in names}
    clients = _clients(servers)
    try:
        for name, client in clients.items():  # unmeasured: first-request costs (allocations, lazy init)
            for rec in (send_turn(client, WARM_UP, turn) for turn in WARM_UP.turns):
                if rec["error"]:
                    raise RuntimeError(f"warm-up request to {name} failed: {rec['error']}")
        step = 0
        for s, session in enumerate(sessions):
            t0 = time.perf_counter()
            recs: dict[str, list[dict]] = {name: [] for name in names}
            if interleave == "turn":
                for turn in session.turns:
                    for name in rotation(names, step):
                        recs[name].append(send_turn(clients[name], session, turn))
                    step += 1
                order = names
            else:
                order = rotation(names, s)
                for name in order:
                    recs[name] = [send_turn(clients[name], session, turn) for turn in session.turns]
            for name in order:
                records[name] += recs[name]
                errors = [r["error"] for r in recs[name] if r["error"]]
                log(f"  session {s + 1}/{len(sessions)} {session.id} via {name}: {len(recs[name])} turns, "
                    f"{sum(r['wall_s'] for r in recs[name]):.1f} s"
                    + (f", {len(errors)} FAILED: {errors[0]}" if errors else ""))
            log(f"    (session took {time.perf_counter() - t0:.1f} s)")
    finally:
        for c in clients.values():
            c.close()
    return records


def is_fresh(flags: list[str]) -> bool:
    """A contender without the prefix cache: every prefill it runs is a fresh one."""
    return "--no-prefix-cache" in flags


def run_probes(servers: dict[str, Server], probes: list[Probe], log=print) -> dict[str, list[dict]]:
    """The TTFT bar's turns: a server with the prefix cache gets probe.cached, then probe.turn (timed);
    one without it gets probe.turn alone. Contender order rotated per probe. Records are tagged
    phase "cached" / "measured" and the probe's number."""
    names = list(servers)
    records: dict[str, list[dict]] = {name: [] for name in names}
    clients = _clients(servers)
    try:
        for j, probe in enumerate(probes):
            for name in rotation(names, j):
                phases = [("measured", probe.turn)] if is_fresh(servers[name].flags) else \
                    [("cached", probe.cached), ("measured", probe.turn)]
                for phase, turn in phases:
                    rec = send_turn(clients[name], probe.session, turn)
                    rec.update(probe=j, phase=phase)
                    records[name].append(rec)
                m = records[name][-1]
                log(f"  probe {j + 1}/{len(probes)} {probe.session.id} turn {probe.turn.k} via {name}: "
                    f"{m['prompt_tokens']} prompt tokens, {m['cached_tokens']} cached, server TTFT "
                    f"{_f(m['server_ttft_s'], '{:.3f}')} s" + (f", FAILED: {m['error']}" if m["error"] else ""))
    finally:
        for c in clients.values():
            c.close()
    return records


# ---------------------------------------------------------------- summary


def identity(records: dict[str, list[dict]]) -> dict:
    names = list(records)
    ref = names[0]
    n = len(records[ref])
    differs = {name: [] for name in names[1:]}
    all_same = 0
    for j in range(n):
        key = reply_key(records[ref][j])
        same = True
        for name in names[1:]:
            if reply_key(records[name][j]) != key:
                r = records[ref][j]
                differs[name].append(f"{r['session']} turn {r['k']}" + (f" (probe {r['probe'] + 1})"
                                                                         if r.get("probe") is not None else ""))
                same = False
        all_same += same
    return {"reference": ref, "turns": n, "identical_turns": all_same, "mismatches": n - all_same,
            "differs_from_reference": differs}


def session_groups(sessions: list[Session], min_turns: int) -> dict[str, list[str]]:
    """The bar's sessions (at least min_turns turns) and, apart, the Claude Code transcripts."""
    groups = {f"long (>= {min_turns} turns)": [s.id for s in sessions if len(s.turns) >= min_turns],
              "claude-code": [s.id for s in sessions if s.source == "claude-code"]}
    return {k: v for k, v in groups.items() if v}


def summarize(records: dict[str, list[dict]], sessions: list[Session], min_turns: int = 0) -> dict:
    names = list(records)
    ref = "baseline" if "baseline" in records else names[0]
    last = {(s.id, t.k) for s in sessions for t in s.turns[-LAST_TURNS:]}
    walls = {name: {s.id: sum(r["wall_s"] for r in recs if r["session"] == s.id) for s in sessions}
             for name, recs in records.items()}
    groups = session_groups(sessions, min_turns)
    out = {"ratio_reference": ref, "groups": groups, "contenders": {}}
    for name, recs in records.items():
        ok = [r for r in recs if not r["error"]]
        drafted = sum(r["drafted_tokens"] or 0 for r in ok)
        accepted = sum(r["accepted_tokens"] or 0 for r in ok)
        prompt = sum(r["prompt_tokens"] or 0 for r in ok)
        cached = sum(r["cached_tokens"] for r in ok)
        sf_cached = [r["sailfish_cached_tokens"] for r in ok if r["sailfish_cached_tokens"] is not None]
        ratios = {s.id: walls[name][s.id] / walls[ref][s.id] for s in sessions if walls[ref][s.id] > 0}
        out["contenders"][name] = {
            "turns": len(recs), "errors": len(recs) - len(ok),
            "ttft_s": spread([r["ttft_s"] for r in ok]),
            "ttft_last_s": spread([r["ttft_s"] for r in ok if (r["session"], r["k"]) in last]),
            "server_ttft_s": spread([r["server_ttft_s"] for r in ok if r.get("server_ttft_s") is not None]),
            "server_ttft_last_s": spread([r["server_ttft_s"] for r in ok if r.get("server_ttft_s") is not None
                                          and (r["session"], r["k"]) in last]),
            "prefill_s": spread([r["prefill_s"] for r in ok if r["prefill_s"] is not None]),
            "decode_tokens_per_s": spread([r["decode_tokens_per_s"] for r in ok if r["decode_tokens_per_s"]]),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": cached / prompt if prompt else None,
            "sailfish_cached_tokens": sum(sf_cached) if sf_cached else None,
            "completion_tokens": sum(r["completion_tokens"] or 0 for r in ok),
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "session_wall_s": walls[name], "session_wall": spread(list(walls[name].values())),
            "total_wall_s": sum(walls[name].values()),
            "wall_ratio": spread(list(ratios.values())) if name != ref else None,
            "groups": {g: {"wall_ratio": spread([ratios[i] for i in ids if i in ratios]),
                           "speedup": spread([1 / ratios[i] for i in ids if ratios.get(i)]),
                           "session_wall": spread([walls[name][i] for i in ids])}
                       for g, ids in groups.items()} if name != ref else None,
        }
    return out


def summarize_probes(records: dict[str, list[dict]], probes: list[Probe], servers: dict[str, list[str]]) -> dict:
    """Per probe and contender: the measured turn's prompt, cached and added tokens, server-side and client-side
    TTFT, and (for contenders with the cache) the ratio of server-side TTFT to the fresh contender's."""
    fresh = next((n for n, flags in servers.items() if is_fresh(flags)), None)
    measured = {name: {r["probe"]: r for r in recs if r.get("phase") == "measured"} for name, recs in records.items()}
    rows = []
    for j, p in enumerate(probes):
        row = {"probe": j, "session": p.session.id, "cached_turn": p.cached.k, "turn": p.turn.k,
               "cached_prompt_tokens": p.cached.prompt_tokens, "prompt_tokens": p.turn.prompt_tokens,
               "recorded_added_tokens": p.added_tokens, "contenders": {}}
        base = measured.get(fresh, {}).get(j) if fresh else None
        for name in records:
            r = measured[name].get(j)
            if r is None:
                continue
            cell = {"server_ttft_s": r.get("server_ttft_s"), "ttft_s": r["ttft_s"], "prefill_s": r["prefill_s"],
                    "queue_s": r.get("queue_s"), "prompt_tokens": r["prompt_tokens"],
                    "cached_tokens": r["cached_tokens"], "error": r["error"],
                    "added_tokens": (r["prompt_tokens"] - r["cached_tokens"]) if r["prompt_tokens"] is not None else None,
                    "ratio": None, "client_ratio": None}
            if base and name != fresh and not r["error"] and not base["error"]:
                if r.get("server_ttft_s") is not None and base.get("server_ttft_s"):
                    cell["ratio"] = r["server_ttft_s"] / base["server_ttft_s"]
                if base["ttft_s"]:
                    cell["client_ratio"] = r["ttft_s"] / base["ttft_s"]
            row["contenders"][name] = cell
        rows.append(row)
    per = {}
    for name in records:
        if name == fresh:
            continue
        ratios = [row["contenders"][name]["ratio"] for row in rows
                  if name in row["contenders"] and row["contenders"][name]["ratio"] is not None]
        client = [row["contenders"][name]["client_ratio"] for row in rows
                  if name in row["contenders"] and row["contenders"][name]["client_ratio"] is not None]
        per[name] = {"ratio": spread(ratios), "client_ratio": spread(client),
                     "meets_bar": None if not ratios else percentile(ratios, 0.5) <= BAR_TTFT_SHARE}
    return {"fresh": fresh, "bar": BAR_TTFT_SHARE, "probes": rows, "contenders": per}


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _sp(d: dict | None, fmt: str = "{:.2f}", lo: str = "p10", hi: str = "p90") -> str:
    if not d or d.get("median") is None:
        return "-"
    return f"{fmt.format(d['median'])} ({fmt.format(d[lo])}-{fmt.format(d[hi])})"


def _num(v) -> str:
    return f"{v:,.0f}" if isinstance(v, float) and v.is_integer() else str(v)


def _mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f} MiB"


def _rel(p: Path) -> str:
    """A path as the report shows it: relative to the repository root (no machine paths in results)."""
    path = Path(p).resolve()
    try:
        rel = os.path.relpath(path, ROOT)
    except ValueError:  # another drive (Windows)
        return str(path)
    return str(path) if rel.startswith(os.path.join(os.pardir, os.pardir)) else rel


def scrub(obj, replacements: list[tuple[str, str]] | None = None):
    """The result with this machine's paths replaced in every string (the repository, its parent, the home
    directory, the temporary directory): results are shared, machine paths are not."""
    if replacements is None:
        replacements = [(str(ROOT), "<repo>"), (str(ROOT.parent), "<repo>/.."), (str(Path.home()), "~"),
                        (tempfile.gettempdir(), "<tmp>")]
        replacements = [(a, b) for a, b in replacements if len(a) > 1]
    if isinstance(obj, str):
        for a, b in replacements:
            obj = obj.replace(a, b)
        return obj
    if isinstance(obj, dict):
        return {scrub(k, replacements): scrub(v, replacements) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, replacements) for v in obj]
    return obj


def markdown(result: dict) -> str:
    cfg, summ, ident = result["config"], result["summary"], result["identical"]
    sessions = result["sessions"]
    probes = result.get("probes") or {}
    n_turns = sum(len(s["turns"]) for s in sessions)
    ref = summ["ratio_reference"]
    lines = ["# Agent sessions through the server", "",
             f"{result['when']}, {result['machine']}. Command: `{result['command']}`.", "",
             f"{len(sessions)} sessions, {n_turns} turns, {len(probes.get('probes') or [])} TTFT probes; "
             f"max_tokens = min(recorded reply, {cfg['max_tokens']}); sessions cut at {cfg['max_turns']} turns or "
             f"{cfg['max_context']} prompt tokens; the bar's sessions have at least {cfg['min_turns']} turns; "
             f"temperature 0, streamed, one request at a time, contender order rotated per "
             f"{cfg.get('interleave', 'session')}. Model: {cfg['model'] or 'bundled Gemma 3 270M (base)'}; "
             f"index: {cfg['index'] or 'the default index'}. Servers' intra-op threads: "
             + (f"{cfg['threads']} (OMP_NUM_THREADS, MKL_NUM_THREADS)" if cfg.get("threads") else "torch's default")
             + f". Run took {result['seconds'] / 60:.1f} min.", ""]
    # the bars first
    lines += ["## The bars", ""]
    for g, ids in summ.get("groups", {}).items():
        for name, c in summ["contenders"].items():
            if name == ref or not c.get("groups") or g not in c["groups"]:
                continue
            sp = c["groups"][g]["speedup"]
            verdict = ""
            if name == "cache+draft" and g.startswith("long") and sp["median"] is not None:
                verdict = (" - meets the 5x bar" if sp["min"] >= BAR_SPEEDUP else
                           " - median meets the 5x bar, not every session" if sp["median"] >= BAR_SPEEDUP
                           else " - below the 5x bar")
            lines.append(f"- Session wall speed-up of `{name}` over `{ref}`, {g} sessions ({len(ids)}): median "
                         f"{_f(sp['median'], '{:.2f}')}x (min {_f(sp['min'], '{:.2f}')}x, max "
                         f"{_f(sp['max'], '{:.2f}')}x){verdict}")
    for name, c in (probes.get("contenders") or {}).items():
        r = c["ratio"]
        verdict = "" if c["meets_bar"] is None else (" - meets the 15% bar" if c["meets_bar"] else " - above the 15% bar")
        lines.append(f"- TTFT of a ~{cfg.get('probe_added')}-token turn on a cached ~{cfg.get('probe_prompt')}-token "
                     f"conversation, `{name}` / fresh prefill (`{probes['fresh']}`), server-side: median "
                     f"{_f(r['median'] and 100 * r['median'], '{:.1f}')}% (min {_f(r['min'] and 100 * r['min'], '{:.1f}')}%"
                     f", max {_f(r['max'] and 100 * r['max'], '{:.1f}')}%, {r['n']} probes){verdict}; client-side "
                     f"median {_f(c['client_ratio']['median'] and 100 * c['client_ratio']['median'], '{:.1f}')}%")
    lines += [f"- Identical replies (text + tool calls) across all contenders: {ident['identical_turns']}/"
              f"{ident['turns']} session turns" + (f", {result['probe_identical']['identical_turns']}/"
                                                   f"{result['probe_identical']['turns']} probe turns"
                                                   if result.get("probe_identical") else "") + "."]
    lines += ["", "## Sessions", "",
              "| session | source | group | turns (recorded) | prompt tokens, first -> last | max_tokens per turn |",
              "|---|---|---|---|---|---|"]
    for s in sessions:
        t = s["turns"]
        group = ", ".join(g for g, ids in summ.get("groups", {}).items() if s["id"] in ids)
        src = s["source"] + (f" ({len(s['parts'])} chained)" if len(s.get("parts") or []) > 1 else "")
        lines.append(f"| {s['id']} | {src} | {group} | {len(t)} ({s['recorded_turns']}) | "
                     f"{t[0]['prompt_tokens']:,} -> {t[-1]['prompt_tokens']:,} | "
                     f"{', '.join(str(x['max_tokens']) for x in t)} |")
    lines += ["", "Contenders (each its own `python -m server --no-trace-log` process):", ""]
    for name, state in result["servers"].items():
        lines.append(f"- `{name}`: `{' '.join(state['flags']) or '(default flags)'}`; drafting: "
                     f"{state.get('drafting', '?')}")
    lines += ["", "Per contender, over every session turn: median (p10-p90); TTFT client-side = first content or "
              "tool-call delta, server-side = usage.sailfish queue_s + prefill_s; 'last' = each session's last "
              f"{LAST_TURNS} turns; session wall = the sum of the client's turn times, median (min-max) over "
              f"sessions; ratio = session wall / {ref}'s, same session, median (min-max).", "",
              "| contender | TTFT s | server TTFT s | server TTFT last s | TTFT last s | decode tok/s | prompt tokens "
              "| cached tokens | accepted/drafted | session wall s | wall ratio | errors |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in summ["contenders"].items():
        cached = f"{c['cached_tokens']:,} ({_f(c['cached_share'] and 100 * c['cached_share'], '{:.0f}')}%)"
        if c["sailfish_cached_tokens"] is not None:
            cached += f"; sailfish {c['sailfish_cached_tokens']:,}"
        ratio = "1 (reference)" if c["wall_ratio"] is None else _sp(c["wall_ratio"], "{:.3f}", "min", "max") + "x"
        lines.append(f"| {name} | {_sp(c['ttft_s'])} | {_sp(c.get('server_ttft_s'), '{:.3f}')} | "
                     f"{_sp(c.get('server_ttft_last_s'), '{:.3f}')} | {_sp(c['ttft_last_s'])} | "
                     f"{_sp(c['decode_tokens_per_s'], '{:.1f}')} | {c['prompt_tokens']:,} | {cached} | "
                     f"{c['accepted_tokens']}/{c['drafted_tokens']} | "
                     f"{_sp(c['session_wall'], '{:.1f}', 'min', 'max')} | {ratio} | {c['errors']} |")
    names = list(summ["contenders"])
    lines += ["", f"Session wall time, s (speed-up over {ref}: {ref} wall / contender wall):", "",
              "| session | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k, s in enumerate(sessions):
        base = summ["contenders"][ref]["session_wall_s"][s["id"]]
        cells = []
        for name in names:
            w = summ["contenders"][name]["session_wall_s"][s["id"]]
            cells.append(f"{w:.1f}" + (f" ({base / w:.2f}x)" if name != ref and base and w else ""))
        lines.append(f"| S{k + 1} {s['id']} | " + " | ".join(cells) + " |")
    if probes.get("probes"):
        cache_names = [n for n in names if n != probes["fresh"]]
        lines += ["", f"## TTFT probes: a turn adding ~{cfg.get('probe_added')} tokens to a cached "
                  f"~{cfg.get('probe_prompt')}-token conversation", "",
                  "Each from a chained session that is not replayed: the contenders with the prefix cache get turn a "
                  "(the conversation so far), then turn b, timed; "
                  f"`{probes['fresh']}` gets turn b alone (a fresh prefill). Server-side TTFT = queue_s + prefill_s, "
                  "in ms; added = b's prompt tokens minus the tokens the cache reused (usage cached_tokens); ratio = "
                  f"server-side TTFT / `{probes['fresh']}`'s; client-side TTFT in parentheses.", "",
                  "| probe | session | turns a -> b | prompt a -> b | " + f"{probes['fresh']} ms | "
                  + " | ".join(f"{n} ms | {n} cached (added) | {n} ratio" for n in cache_names) + " |",
                  "|---|---|---|---|---|" + "---|---|---|" * len(cache_names)]
        for row in probes["probes"]:
            c = row["contenders"]
            fr = c.get(probes["fresh"], {})
            cells = [f"{_f(fr.get('server_ttft_s') and 1000 * fr['server_ttft_s'], '{:.0f}')} "
                     f"({_f(fr.get('ttft_s') and 1000 * fr['ttft_s'], '{:.0f}')})"]
            for n in cache_names:
                x = c.get(n, {})
                cells += [f"{_f(x.get('server_ttft_s') and 1000 * x['server_ttft_s'], '{:.0f}')} "
                          f"({_f(x.get('ttft_s') and 1000 * x['ttft_s'], '{:.0f}')})",
                          f"{_f(x.get('cached_tokens'), '{:,}')} ({_f(x.get('added_tokens'), '{:,}')})",
                          _f(x.get("ratio") and 100 * x["ratio"], "{:.1f}%")]
            lines.append(f"| {row['probe'] + 1} | {row['session']} | {row['cached_turn']} -> {row['turn']} | "
                         f"{row['cached_prompt_tokens']:,} -> {row['prompt_tokens']:,} | " + " | ".join(cells) + " |")
        for n, c in probes["contenders"].items():
            lines.append(f"\n`{n}`: ratio median {_f(c['ratio']['median'] and 100 * c['ratio']['median'], '{:.1f}')}%"
                         f" over {c['ratio']['n']} probes (bar: at most {100 * probes['bar']:.0f}%); client-side "
                         f"{_f(c['client_ratio']['median'] and 100 * c['client_ratio']['median'], '{:.1f}')}%.")
    lines += ["", "## Identity, memory, prefix cache", "",
              f"Identical replies (text + tool calls, turn by turn) across all contenders: "
              f"{ident['identical_turns']}/{ident['turns']} session turns; {ident['mismatches']} mismatched."]
    for name, where in ident["differs_from_reference"].items():
        if where:
            lines.append(f"- `{name}` differs from `{ident['reference']}` in {len(where)} turns: "
                         + ", ".join(where[:10]) + (" ..." if len(where) > 10 else ""))
    pid = result.get("probe_identical")
    if pid:
        lines.append(f"Probe turns (the timed turn b): {pid['identical_turns']}/{pid['turns']} identical.")
        for name, where in pid["differs_from_reference"].items():
            if where:
                lines.append(f"- `{name}` differs from `{pid['reference']}` in: " + ", ".join(where))
    lines += ["", "Servers after the run (peak RSS from /proc VmHWM; prefix cache from /health):", "",
              "| contender | peak RSS | prefix cache peak / budget | kept now (entries) | evictions | hits / requests "
              "| reused / computed tokens | start-up s |", "|---|---|---|---|---|---|---|---|"]
    for name, st in result["servers"].items():
        pc = prefix_cache_use(st)
        rss = st.get("peak_rss_bytes")
        if pc:
            cells = [f"{_mib(pc.get('peak_bytes'))} / {_mib(pc.get('budget_bytes'))}",
                     f"{_mib(pc.get('bytes'))} ({_num(pc.get('entries'))})", _num(pc.get("evictions")),
                     f"{_num(pc.get('hits'))} / {_num(pc.get('requests'))}",
                     f"{_f(pc.get('reused_tokens'), '{:,}')} / {_f(pc.get('computed_tokens'), '{:,}')}"]
        else:
            cells = ["off"] + ["-"] * 4
        lines.append(f"| {name} | {_mib(rss)} | " + " | ".join(cells) + f" | {st['startup_s']:.0f} |")
    problems = {n: st.get("log_problems") for n, st in result["servers"].items() if st.get("log_problems")}
    if problems:
        lines += ["", "Server log lines that look like errors:", ""]
        for n, ls in problems.items():
            lines += [f"- `{n}`: `{x}`" for x in ls[:5]]
    if result["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    lines += ["", "Caveats: the long sessions are held-out BFCL multi-turn conversations with the same tool list "
              "put end to end (an agent doing several tasks in one conversation; each task starts from its own "
              "environment state, which the messages do not show), not one recorded session; sessions with the same tool "
              "list share the tool declarations, so a later one starts with them cached by an earlier one (as an "
              "agent's next session would); the Claude Code "
              "transcripts are real single sessions but too short (in turns under the context cut) for the bar. "
              "The bundled model is a base model whose replies echo and loop, so drafting speed-ups on it are "
              "inflated; every held-out BFCL multi-turn question has a sibling variant in the index split, which "
              "inflates drafting on BFCL sessions further. The prefix cache's gain does not depend on what the "
              "model says. A reply that starts with a tool call has its client-side TTFT when that call is complete "
              "(the server streams calls whole), so the TTFT bar uses server-side TTFT.", ""]
    return "\n".join(lines)


def chart(path: Path, records: dict[str, list[dict]], sessions: list[Session], summary: dict | None = None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for c, (name, recs) in enumerate(records.items()):
        for j, s in enumerate(sessions):
            pts = [(r["prompt_tokens"] or r["expected_prompt_tokens"],
                    r["server_ttft_s"] if r.get("server_ttft_s") else r["ttft_s"])
                   for r in recs if r["session"] == s.id and not r["error"]]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", ms=3, lw=1, color=colors[c % len(colors)],
                        label=name if j == 0 else None)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, s (server-side: queue + prefill; log scale)")
    ax.set_title("TTFT per turn (one line per session and contender)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if summary:
        names = list(summary["contenders"])
        width = 0.8 / len(names)
        for c, name in enumerate(names):
            walls = [summary["contenders"][name]["session_wall_s"][s.id] for s in sessions]
            bx.bar([k + c * width for k in range(len(sessions))], walls, width, color=colors[c % len(colors)],
                   label=name)
        bx.set_xticks([k + 0.4 - width / 2 for k in range(len(sessions))])
        bx.set_xticklabels([f"S{k + 1}" for k in range(len(sessions))])
        bx.set_ylabel("session wall time, s")
        bx.set_title("Session wall time (S1.. as in the report's table)")
        bx.grid(True, axis="y", alpha=0.3)
        bx.legend()
    else:
        bx.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- main


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _default_max_context() -> int:
    return CUDA_MAX_CONTEXT if _cuda() else CPU_MAX_CONTEXT


def _default_threads() -> int:
    """Half the cores (at least 1) on a CPU-only machine; 0 (torch's default) with CUDA."""
    return 0 if _cuda() else max(1, (os.cpu_count() or 2) // 2)


def _tokenizer(model: str | None, notes: list[str]):
    from common.tokenizer import load_tokenizer

    if model and Path(model).is_dir():
        return load_tokenizer(model)
    if model:
        notes.append(f"token budgets use the bundled model's tokenizer (--model {model} is not a directory); "
                     "usage.prompt_tokens is the server's own count")
    return load_tokenizer(None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.agent_sessions", description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, help=f"sessions with at least --min-turns turns to replay "
                   f"(default {DEFAULTS['sessions']})")
    p.add_argument("--max-turns", type=int, help=f"turns per session at most; also where a chain of BFCL "
                   f"conversations closes (default {DEFAULTS['max_turns']})")
    p.add_argument("--max-context", type=int, help=f"stop a session before a prompt longer than this, in tokens "
                   f"(default {CPU_MAX_CONTEXT} on CPU, {CUDA_MAX_CONTEXT} with CUDA)")
    p.add_argument("--min-turns", type=int, help=f"the bar's sessions have at least this many turns "
                   f"(default {DEFAULTS['min_turns']})")
    p.add_argument("--max-tokens", type=int, help=f"cap on each turn's max_tokens (default {DEFAULTS['max_tokens']})")
    p.add_argument("--claude-sessions", type=int, help="Claude Code transcripts with fewer than --min-turns turns "
                   f"(at least 2) replayed too, reported apart (default {DEFAULTS['claude_sessions']})")
    p.add_argument("--probes", type=int, help=f"TTFT-bar turns to measure (default {DEFAULTS['probes']}; 0: none)")
    p.add_argument("--probe-prompt", type=int, help=f"their cached conversation's length, tokens "
                   f"(default {DEFAULTS['probe_prompt']})")
    p.add_argument("--probe-added", type=int, help=f"the tokens their turn adds (default {DEFAULTS['probe_added']})")
    p.add_argument("--threads", type=int, help="intra-op threads of every server (OMP_NUM_THREADS and "
                   "MKL_NUM_THREADS; 0: torch's default, one per core); default: half the cores, at least 1, on a "
                   "CPU-only machine, 0 with CUDA")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated, from {', '.join(CONTENDERS)} (default: all three)")
    p.add_argument("--model", help="passed to every server (default: the bundled Gemma 3 270M)")
    p.add_argument("--index", help="passed to every server (default: the default index)")
    p.add_argument("--port-base", type=int, default=0,
                   help="servers listen on PORT_BASE, PORT_BASE+1, ... (default 0: free ports)")
    p.add_argument("--claude-samples", type=Path, default=DEFAULT_CLAUDE_SAMPLES,
                   help="directory of Claude Code transcripts (default <repo>/../shared/data/claude-code-samples)")
    p.add_argument("--bfcl-categories", nargs="*", default=list(BFCL_MULTI_TURN),
                   help="BFCL v4 categories whose held-out conversations are chained into sessions (none: no BFCL)")
    p.add_argument("--out", type=Path, help="markdown report; .json and .png go beside it "
                   "(default bench/results/agent_sessions.md, agent_sessions-quick.md with --quick)")
    p.add_argument("--interleave", choices=("session", "turn"), default="session",
                   help="rotate the contenders' order per session (default: each replays a whole session in "
                        "turn) or per turn (each turn goes to every contender before the next turn)")
    p.add_argument("--quick", action="store_true", help=f"small: {QUICK}")
    p.add_argument("--dry-run", action="store_true", help="list the sessions and what exists, start no server")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_context is None:
        args.max_context = _default_max_context()
    if args.threads is None:
        args.threads = _default_threads()
    if args.out is None:
        args.out = DEFAULT_OUT.with_name("agent_sessions-quick.md") if args.quick else DEFAULT_OUT
    return args


def _session_json(s: Session) -> dict:
    return {"id": s.id, "source": s.source, "parts": s.parts, "recorded_turns": s.recorded_turns,
            "turns": [asdict(t) for t in s.turns]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown or not contenders or len(set(contenders)) != len(contenders):
        print(f"--contenders: pick distinct names from {', '.join(CONTENDERS)} (got {args.contenders!r})",
              file=sys.stderr)
        return 2
    if not args.dry_run:
        missing = missing_flags(contenders, server_flags())
        if missing:
            need = [c for c in contenders if set(CONTENDERS[c]) & set(missing)]
            print(f"the server has no {', '.join(missing)} flag (see `python -m server --help`), needed by contender(s) "
                  f"{', '.join(need)}. Run the others meanwhile, e.g. --contenders "
                  f"{','.join(c for c in CONTENDERS if c not in need) or '...'}", file=sys.stderr)
            return 2

    t_start = time.perf_counter()
    notes: list[str] = []
    tok = _tokenizer(args.model, notes)
    from common.chat_format import ChatFormat

    fmt = ChatFormat.for_tokenizer(tok)
    recorded = load_conversations(args.claude_samples, args.bfcl_categories, notes)
    candidates = chain_conversations(recorded, lambda m, t: last_prompt_tokens(fmt, tok, m, t),
                                     args.max_context, args.max_turns)
    all_sessions = build_sessions(candidates, lambda c: turn_token_counts(fmt, tok, c.messages, c.tools),
                                  args.max_tokens, args.max_turns, args.max_context, notes)
    sessions = select_sessions(all_sessions, args.sessions, args.min_turns, args.claude_sessions)
    probes = plan_probes(all_sessions, sessions, args.probes, args.probe_prompt, args.probe_added) \
        if args.probes else []
    n_chained = sum(len(c.parts) > 1 for c in candidates)
    print(f"{len(recorded)} conversations ({sum(c.source == 'claude-code' for c in recorded)} Claude Code, "
          f"{sum(c.source == 'bfcl' for c in recorded)} held-out BFCL -> {n_chained} chains of 2 or more); cut at "
          f"{args.max_turns} turns / {args.max_context} prompt tokens; the bar's sessions have at least "
          f"{args.min_turns} turns")
    for n in notes:
        print("  note:", n)
    if args.dry_run or not sessions:
        longest = select_sessions(all_sessions, 12, 1)
        print("longest sessions that exist under these cuts (turns kept / recorded, prompt tokens first -> last):")
        for s in longest:
            print(f"  {s.id}: {len(s.turns)}/{s.recorded_turns}, {s.turns[0].prompt_tokens} -> "
                  f"{s.turns[-1].prompt_tokens} (whole recording up to {s.recorded_last_prompt})")
    long_ones = [s for s in sessions if len(s.turns) >= args.min_turns]
    if not long_ones:
        print(f"no session has {args.min_turns} turns under {args.max_context} tokens: lower --min-turns or raise "
              "--max-context", file=sys.stderr)
        return 2
    if len(long_ones) < args.sessions:
        notes.append(f"only {len(long_ones)} sessions have {args.min_turns} turns under {args.max_context} tokens "
                     f"(asked for {args.sessions})")
    if len(probes) < args.probes:
        notes.append(f"only {len(probes)} TTFT probes of ~{args.probe_added} tokens on ~{args.probe_prompt} exist "
                     f"among the sessions not replayed (asked for {args.probes})")
    print(f"selected {len(sessions)} sessions, {sum(len(s.turns) for s in sessions)} turns:")
    for s in sessions:
        print(f"  {s.id} ({s.source}, {len(s.parts)} conversations): {len(s.turns)} turns, prompt "
              f"{s.turns[0].prompt_tokens} -> {s.turns[-1].prompt_tokens} tokens, max_tokens "
              f"{sum(t.max_tokens for t in s.turns)} in all")
    print(f"{len(probes)} TTFT probes:")
    for p in probes:
        print(f"  {p.session.id}: turn {p.cached.k} ({p.cached.prompt_tokens} tokens) -> turn {p.turn.k} "
              f"(+{p.added_tokens})")
    if args.dry_run:
        return 0

    extra = (["--model", args.model] if args.model else []) + (["--index", args.index] if args.index else [])
    servers: dict[str, Server] = {}
    probe_records: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="sailfish-agent-sessions-") as tmp:
        try:
            for k, name in enumerate(contenders):
                port = args.port_base + k if args.port_base else free_port()
                env = thread_env(args.threads)
                print(f"starting {name}: {' '.join(f'{k}={v}' for k, v in env.items())} python -m server --port {port} "
                      f"--no-trace-log {' '.join(CONTENDERS[name] + extra)}".replace(":  ", ": "), flush=True)
                servers[name] = start_server(name, CONTENDERS[name] + extra, port, Path(tmp) / f"{name}.log", env=env)
                print(f"  ready in {servers[name].startup_s:.0f} s", flush=True)
            records = replay(servers, sessions, args.interleave, log=lambda m: print(m, flush=True))
            if probes:
                probe_records = run_probes(servers, probes, log=lambda m: print(m, flush=True))
            states = {name: server_state(srv) for name, srv in servers.items()}
        finally:
            for srv in servers.values():
                stop_server(srv.proc)

    for name, st in states.items():
        if name != "baseline" and "draft" in name and "health" in st and st["health"].get("index") is None:
            notes.append(f"{name} had no index, so it drafted from the live context only: {st['drafting']} "
                         "(build one with `make index`, or pass --index)")
    measured = {n: [r for r in recs if r["phase"] == "measured"] for n, recs in probe_records.items()}
    result = {
        "name": "agent_sessions", **run_header(),
        "command": " ".join(["python -m bench.agent_sessions", *argv]).strip(),
        "seconds": time.perf_counter() - t_start,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("claude_samples", "out")} | {"claude_samples": _rel(args.claude_samples),
                                                            "contenders": contenders},
        "sessions": [_session_json(s) for s in sessions],
        "servers": states, "notes": notes,
        "identical": identity(records), "summary": summarize(records, sessions, args.min_turns),
        "probes": summarize_probes(probe_records, probes, {n: s.flags for n, s in servers.items()}) if probes else None,
        "probe_identical": identity(measured) if probes else None,
        "probe_sessions": [_session_json(p.session) for p in probes],
        "turns": records, "probe_turns": probe_records,
    }
    result = scrub(result)
    md = markdown(result)
    print()
    print(md)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    written = [out, out.with_suffix(".json")]
    if chart(out.with_suffix(".png"), records, sessions, result["summary"]):
        written.append(out.with_suffix(".png"))
    else:
        print("note: matplotlib is not importable: no chart (pip install matplotlib, or the `bench` extra)")
    print("wrote " + ", ".join(_rel(p) for p in written))
    bad = (result["identical"]["mismatches"] or any(c["errors"] for c in result["summary"]["contenders"].values())
           or (probes and result["probe_identical"]["mismatches"])
           or any(r["error"] for recs in probe_records.values() for r in recs))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
