"""The benchmark's fixed, versioned prompt sets. WORKLOAD_VERSION changes whenever any set changes.

1. tool_calls: BFCL v4 (the `bfcl-eval` package, Apache-2.0) held-out conversations, multi_turn and
   live categories; each request is the conversation up to its last assistant turn.
2. agentic: multi-step coding sessions with file and shell tools. Two public sources:
   - the three real Claude Code transcripts shipped in shared data (MIT, see tests/fixtures), each
     request the session up to one of its assistant turns;
   - sessions generated over the CPython standard library's own source (PSF license): an agent greps
     for a function, reads it, edits it, runs a test command; tool results are the real grep hits and
     file lines. Modules are split by a hash of their name: `agentic_index_conversations` (traces for
     the index) and the requests never share a module.
3. prose: reasoning-style prose and arithmetic, where n-gram drafting should not pay: explanations
   of standard-library module docstrings (real prose) and multi-step arithmetic word problems.
Every set is deterministic (fixed seeds, sorted sources).
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import sysconfig
from pathlib import Path

from index.bfcl import bfcl_split, iter_bfcl_conversations
from common.paths import BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED
from index.traces import Conversation, ReadReport, iter_conversations

WORKLOAD_VERSION = "1"
CLAUDE_SAMPLES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"

_TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": list(props)}}}
    for name, desc, props in [
        ("grep", "Search files for a regular expression", {"pattern": "string", "path": "string"}),
        ("read_file", "Read lines of a file", {"path": "string", "start_line": "integer", "end_line": "integer"}),
        ("edit_file", "Replace text in a file", {"path": "string", "old": "string", "new": "string"}),
        ("run_shell", "Run a shell command", {"command": "string"}),
    ]
]


def _request(messages, tools, rid: str) -> dict:
    return {"id": rid, "messages": messages, "tools": tools}


def _upto_last_assistant(conv: Conversation) -> list[dict] | None:
    last = max((i for i, m in enumerate(conv.messages) if m["role"] == "assistant"), default=None)
    return conv.messages[:last] if last else None


def tool_call_requests(limit: int) -> list[dict]:
    _, hold = bfcl_split(iter_bfcl_conversations(), BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED)
    pools = {"multi_turn": [], "live": []}
    for conv in hold:
        cat = conv.source.split("/", 1)[-1]
        key = "multi_turn" if cat.startswith("multi_turn") else "live" if cat.startswith("live") else None
        msgs = _upto_last_assistant(conv) if key else None
        if msgs:
            pools[key].append(_request(msgs, conv.tools, conv.id))
    out = []
    for a, b in zip(pools["multi_turn"], pools["live"]):  # alternate the two kinds
        out += [a, b]
    return out[:limit]


def _stdlib_functions() -> list[tuple[str, int, str, list[str]]]:
    """(relative path, line, function name, file lines) for public top-level functions, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for pkg in ("json", "email", "http", "urllib", "logging", "asyncio", "concurrent", "xml/dom",
                "importlib", "unittest", "sqlite3", "html", "wsgiref", "tomllib", "zoneinfo"):
        for path in sorted((root / pkg).glob("*.py")):
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            for i, line in enumerate(lines):
                m = re.match(r"def ([a-z][a-z0-9_]+)\(", line)
                if m:
                    found.append((str(path.relative_to(root)), i + 1, m.group(1), lines))
    return found


def _in_index_split(module: str) -> bool:
    return hashlib.sha256(module.encode()).digest()[0] % 2 == 0


def _stdlib_session(rel: str, line: int, name: str, lines: list[str], rng: random.Random) -> tuple[list, list]:
    """(messages up to the final assistant turn, the final assistant message)."""
    pkg = rel.rsplit("/", 1)[0] if "/" in rel else rel
    grep_hits = "\n".join(f"{rel}:{i + 1}:{ln}" for i, ln in enumerate(lines) if name in ln)[:1500]
    start, end = max(1, line - 2), min(len(lines), line + 18)
    body = "\n".join(f"{i:>5}\t{lines[i - 1]}" for i in range(start, end + 1))
    test = f"python -m pytest tests/test_{Path(rel).stem}.py -q"
    calls = [
        ("grep", {"pattern": f"def {name}", "path": f"{pkg}/"}, grep_hits or "no matches"),
        ("read_file", {"path": rel, "start_line": start, "end_line": end}, body),
        ("edit_file", {"path": rel, "old": lines[line - 1], "new": lines[line - 1] + f"\n    # reviewed: {name}"}, "ok"),
        ("run_shell", {"command": test}, f"{rng.randint(3, 60)} passed in {rng.randint(1, 9)}.{rng.randint(0, 99):02d}s"),
    ]
    messages = [{"role": "user", "content": f"In {pkg}, find where `{name}` is defined, mark it as reviewed with a comment, and run its tests."}]
    for n, (tool, args, result) in enumerate(calls):
        cid = f"call_{n}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}]})
        messages.append({"role": "tool", "tool_call_id": cid, "name": tool, "content": result})
    final = {"role": "assistant", "content": f"Marked `{name}` in `{rel}` as reviewed; `{test}` passes."}
    return messages, final


def agentic_index_conversations(limit: int = 400) -> list[Conversation]:
    rng = random.Random(1)
    out = []
    for rel, line, name, lines in _stdlib_functions():
        if _in_index_split(rel) and len(out) < limit:
            msgs, final = _stdlib_session(rel, line, name, lines, rng)
            out.append(Conversation(messages=msgs + [final], tools=_TOOLS, source="stdlib-agent", line=line, id=f"{rel}:{name}"))
    return out


def agentic_requests(limit: int) -> list[dict]:
    rng = random.Random(2)
    requests = []
    report = ReadReport()
    for conv in iter_conversations([CLAUDE_SAMPLES / "claude_code_short.jsonl", CLAUDE_SAMPLES / "claude_code_split_message.jsonl"], report):
        msgs = _upto_last_assistant(conv)
        if msgs:
            requests.append(_request(msgs, conv.tools, f"claude:{Path(conv.source).name}"))
    picks = [f for f in _stdlib_functions() if not _in_index_split(f[0])]
    rng.shuffle(picks)
    for rel, line, name, lines in picks:
        msgs, _ = _stdlib_session(rel, line, name, lines, rng)
        cut = rng.choice([1, 3, 5, 7])  # up to one of the four tool-call turns
        requests.append(_request(msgs[:cut], _TOOLS, f"stdlib:{rel}:{name}:{cut}"))
        if len(requests) >= limit:
            break
    # interleave the real transcripts among the generated sessions
    return requests[:limit]


def prose_requests(limit: int) -> list[dict]:
    rng = random.Random(3)
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for mod in ("argparse", "heapq", "bisect", "difflib", "fractions", "statistics", "textwrap", "shlex"):
        text = (root / f"{mod}.py").read_text(encoding="utf-8")
        m = re.search(r'"""(.*?)"""', text, re.S)
        if m:
            para = " ".join(m.group(1).split())[:600]
            docs.append(f"Explain in your own words, step by step, what this module is for and when you would use it:\n\n{para}")
    requests = []
    for i in range(limit):
        if i % 2 == 0 and docs:
            content = docs[(i // 2) % len(docs)]
        else:
            a, b, c = rng.randint(12, 97), rng.randint(3, 19), rng.randint(2, 9)
            content = (f"A shop sells {a} notebooks on Monday and {b} times as many on Tuesday. On Wednesday it sells "
                       f"{c} fewer than a third of Tuesday's sales. Reason step by step: how many notebooks did it sell in total?")
        requests.append(_request([{"role": "user", "content": content}], [], f"prose:{i}"))
    return requests


WORKLOADS = {"tool_calls": tool_call_requests, "agentic": agentic_requests, "prose": prose_requests}
