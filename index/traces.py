"""Trace readers: recorded tool-calling sessions in, OpenAI-format conversations out.

Contract: `iter_conversations(paths, report)` yields `Conversation`s (OpenAI chat `messages`,
OpenAI `tools`, the source file and line) from files or directories (directories are searched
recursively for `*.jsonl`). The format is detected per file from its first parseable lines:

- OpenAI chat JSONL: one conversation per line, `{"messages": [...], "tools": [...]}` (`tools`
  optional). Tool-call `function.arguments` may be a JSON string or an object; both come out as
  a JSON string. A `developer` role is read as `system`.
- Claude Code session logs (`~/.claude/projects/<project>/<session>.jsonl`): one event per line.
  The main chain of a file becomes ONE conversation. Subagent work (`isSidechain: true`, found in
  `<session>/subagents/agent-<id>.jsonl` files or inline in older logs) becomes a separate
  conversation per `agentId`; `progress` events (which echo subagent messages) and every other
  non-message event (summary, system, file-history-snapshot, queue-operation, ...) are ignored.
  Assistant events sharing `message.id` are parts of one message and are merged, even when tool
  results were logged between them. Text blocks are stripped and joined with a blank line;
  `thinking` blocks are dropped (they are not what a target model would emit); `tool_use` becomes
  a tool call; `tool_result` becomes a `tool` message (text blocks joined with a newline). Logs
  carry no tool schemas, so `tools` lists the names used with `parameters: {"type": "object"}`.

ANSI escape sequences are stripped from all text, tool arguments included. Bad input never
raises: malformed lines (invalid JSON, a string holding a lone surrogate, wrong shape, unknown
roles, missing fields) and orphan tool results are skipped and recorded in the `ReadReport`. A
conversation with no assistant turn is still yielded; the caller decides when zero usable turns
is an error.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from common.chat_format import MAX_VALUE_DEPTH, json_depth
from common.json_text import lone_surrogate_at, may_hold_lone_surrogate


ROLES = ("system", "user", "assistant", "tool")
_CLAUDE_EVENT_TYPES = {"user", "assistant", "summary", "system", "progress",
                       "file-history-snapshot", "queue-operation"}
_DETECT_LINES = 20

# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ESC \), DCS/SOS/PM/APC strings, charset
# selection (ESC ( B), other two-byte escapes, and the 8-bit CSI form.
_ANSI_RE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"
    r"|\x1b[()*+][0-9A-Za-z]"
    r"|\x1b[@-Z\\-_=>78]"
    r"|\x9b[0-?]*[ -/]*[@-~]"
)


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict]
    source: str
    line: int
    id: str = ""  # stable identifier when the source has one (BFCL ids); else "source:line"

    def key(self) -> str:
        return self.id or f"{self.source}:{self.line}"


@dataclass
class ReadReport:
    files: int = 0
    lines: int = 0
    conversations: int = 0
    skipped: list[tuple[str, int, str]] = field(default_factory=list)
    by_format: Counter = field(default_factory=Counter)
    unreadable: list[str] = field(default_factory=list)  # sources that could not be read at all (also in skipped)

    def skip(self, source: str, line: int, reason: str) -> None:
        self.skipped.append((source, line, reason))

    def summary(self, limit: int = 20) -> str:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_format.items()))
        out = [f"read {self.files} files, {self.lines} lines, {self.conversations} conversations"
               + (f" ({kinds})" if kinds else "") + f"; skipped {len(self.skipped)}"]
        for source, line, reason in self.skipped[:limit]:
            out.append(f"  {source}:{line}: {reason}")
        if len(self.skipped) > limit:
            out.append(f"  ... and {len(self.skipped) - limit} more")
        return "\n".join(out)


# A trace line's nesting: a record's envelope (messages, a call, its function) around values the chat
# format renders up to MAX_VALUE_DEPTH deep; deeper lines are skipped before any reader recurses.
MAX_LINE_DEPTH = 2 * MAX_VALUE_DEPTH


class BadLine(ValueError):
    """A line (or message inside it) that does not have the expected shape."""


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text) if ("\x1b" in text or "\x9b" in text) else text


def strip_ansi_deep(value: Any) -> Any:
    if isinstance(value, str):
        return strip_ansi(value)
    if isinstance(value, list):
        return [strip_ansi_deep(v) for v in value]
    if isinstance(value, dict):
        return {strip_ansi(k) if isinstance(k, str) else k: strip_ansi_deep(v) for k, v in value.items()}
    return value


def normalize_arguments(arguments: Any) -> str:
    """Tool-call arguments as a JSON string, ANSI stripped. Unparseable strings, and JSON strings nested
    deeper than the chat format renders (MAX_VALUE_DEPTH), stay as text; such an object is a BadLine."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            return strip_ansi(arguments)
        if json_depth(parsed) > MAX_VALUE_DEPTH:
            return strip_ansi(arguments)
        return json.dumps(strip_ansi_deep(parsed), ensure_ascii=False)
    if isinstance(arguments, (dict, list)):
        if json_depth(arguments) > MAX_VALUE_DEPTH:
            raise BadLine(f"arguments nested deeper than {MAX_VALUE_DEPTH} levels")
        return json.dumps(strip_ansi_deep(arguments), ensure_ascii=False)
    raise BadLine(f"arguments of type {type(arguments).__name__}")


def trace_files(paths: Iterable[str | Path], report: ReadReport) -> Iterator[Path]:
    """The trace files named, or found under named directories (recursively, `*.jsonl` files only:
    not a directory so named). A link found there that leads nowhere, and a named path that does not
    exist, are skipped and reported."""
    for p in paths:
        p = Path(p)
        if p.is_dir():
            for f in sorted(p.rglob("*.jsonl")):
                if f.is_file():
                    yield f
                elif f.is_symlink():
                    report.skip(str(f), 0, "a link to nothing (no such file)")
        elif p.is_file():
            yield p
        else:
            report.skip(str(p), 0, "no such file or directory")


def iter_conversations(paths: list[str | Path], report: ReadReport) -> Iterator[Conversation]:
    for path in trace_files(paths, report):
        report.files += 1
        try:
            lines = _text_lines(str(path), path.read_bytes(), report)
        except OSError as e:
            report.skip(str(path), 0, f"unreadable: {e}")
            report.unreadable.append(str(path))
            continue
        report.lines += len(lines)
        kind = _detect(lines)
        if kind == "openai":
            convs = _read_openai(str(path), lines, report)
        elif kind == "claude-code":
            convs = _read_claude(str(path), lines, report)
        else:
            report.skip(str(path), 0, "unknown format (neither OpenAI chat JSONL nor a Claude Code log)")
            continue
        for conv in convs:
            report.conversations += 1
            report.by_format[kind] += 1
            yield conv


def _text_lines(source: str, data: bytes, report: ReadReport) -> list[str]:
    """A file's lines as text: UTF-8 (a byte-order mark dropped), or UTF-16 where its mark says so.
    A line that is not UTF-8 (a Latin-1 file's accents, say) is blanked, skipped and reported: read
    with replacement characters it would index text the model never sees."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return _split_lines(data.decode("utf-16"))
        except UnicodeDecodeError:
            report.skip(source, 0, "not UTF-16 text after its UTF-16 byte-order mark")
            return []
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return _split_lines(data.decode("utf-8"))
    except UnicodeDecodeError:
        pass
    lines = []
    for no, raw in enumerate(_split_lines(data.decode("utf-8", errors="surrogateescape")), 1):
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError:
            report.skip(source, no, "not UTF-8 text (another encoding? traces are read as UTF-8)")
            raw = ""
        lines.append(raw)
    return lines


def _split_lines(text: str) -> list[str]:
    """JSONL lines: split at "\n" only (a "\r" before it dropped). str.splitlines would also split
    at U+2028, U+0085 and other characters a JSON string may hold unescaped (the trace log writes
    them so), breaking one record into two invalid lines."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _detect(lines: list[str]) -> str | None:
    seen = 0
    for line in lines:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("messages"), list):
            return "openai"
        if obj.get("type") in _CLAUDE_EVENT_TYPES and ("sessionId" in obj or "message" in obj
                                                        or "uuid" in obj or "messageId" in obj):
            return "claude-code"
        seen += 1
        if seen >= _DETECT_LINES:
            break
    return None


# ---------------------------------------------------------------- OpenAI chat JSONL

def _text_of(content: Any, what: str) -> str:
    """OpenAI content: a string, None, or a list of parts of which the text ones are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return strip_ansi(content)
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif not isinstance(part, dict):
                raise BadLine(f"{what}: content part of type {type(part).__name__}")
        return strip_ansi("".join(parts))
    raise BadLine(f"{what}: content of type {type(content).__name__}")


def _openai_tool_call(call: Any, where: str, k: int) -> dict:
    if not isinstance(call, dict):
        raise BadLine(f"{where}: tool call is not an object")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadLine(f"{where}: tool call without function.name")
    return {"id": str(call.get("id") or f"call_{k}"), "type": "function",
            "function": {"name": strip_ansi(fn["name"]),
                         "arguments": normalize_arguments(fn.get("arguments"))}}


def parse_openai_messages(raw: Any) -> list[dict]:
    """Validate and normalize a list of OpenAI chat messages; raises BadLine."""
    if not isinstance(raw, list):
        raise BadLine("messages is not a list")
    out: list[dict] = []
    n_calls = 0
    for i, m in enumerate(raw):
        where = f"message {i}"
        if not isinstance(m, dict):
            raise BadLine(f"{where}: not an object")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise BadLine(f"{where}: unknown role {role!r}")
        msg: dict = {"role": role, "content": _text_of(m.get("content"), where)}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise BadLine(f"{where}: tool_calls is not a list")
            if calls:
                msg["tool_calls"] = [_openai_tool_call(c, where, n_calls + k) for k, c in enumerate(calls)]
                n_calls += len(calls)
            elif m.get("content") is None:
                raise BadLine(f"{where}: assistant message with neither content nor tool_calls")
        elif role == "tool":
            if not m.get("tool_call_id") and not m.get("name"):
                raise BadLine(f"{where}: tool message without tool_call_id")
            if m.get("tool_call_id"):
                msg["tool_call_id"] = str(m["tool_call_id"])
        if isinstance(m.get("name"), str) and role in ("tool", "user"):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_openai_tools(raw: Any) -> list[dict]:
    """Validate OpenAI tools (bare `{name, parameters}` function objects are wrapped)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadLine("tools is not a list")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and "function" in t else t
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadLine(f"tool {i}: no function name")
        params = fn.get("parameters") or {"type": "object"}
        if not isinstance(params, dict):
            raise BadLine(f"tool {i}: parameters is not an object")
        if json_depth(params) > MAX_VALUE_DEPTH:   # the chat format refuses to render it
            raise BadLine(f"tool {i}: parameters nested deeper than {MAX_VALUE_DEPTH} levels")
        f = {"name": fn["name"], "parameters": params}
        if isinstance(fn.get("description"), str):
            f["description"] = fn["description"]
        tools.append({"type": "function", "function": f})
    return tools


def _json_lines(source: str, lines: list[str], report: ReadReport) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line; invalid JSON, and JSON whose strings
    hold a lone surrogate (no tokenizer takes it), is skipped and reported."""
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            report.skip(source, no, f"invalid JSON: {e.msg}")
            continue
        except RecursionError:
            report.skip(source, no, "JSON nested too deeply to read")
            continue
        if json_depth(value, MAX_LINE_DEPTH) > MAX_LINE_DEPTH:
            report.skip(source, no, f"JSON nested deeper than {MAX_LINE_DEPTH} levels")
            continue
        where = lone_surrogate_at(value) if may_hold_lone_surrogate(line) else None
        if where is not None:
            report.skip(source, no, f"a lone UTF-16 surrogate in {where} (not text)")
            continue
        yield no, value


def _read_openai(source: str, lines: list[str], report: ReadReport) -> Iterator[Conversation]:
    for no, obj in _json_lines(source, lines, report):
        if not isinstance(obj, dict) or "messages" not in obj:
            report.skip(source, no, "not an object with 'messages'")
            continue
        try:
            messages = parse_openai_messages(obj["messages"])
            tools = parse_openai_tools(obj.get("tools"))
        except BadLine as e:
            report.skip(source, no, str(e))
            continue
        yield Conversation(messages=messages, tools=tools, source=source, line=no,
                           id=str(obj["id"]) if isinstance(obj.get("id"), (str, int)) else "")


# ---------------------------------------------------------------- Claude Code session logs

class _ClaudeThread:
    """Builds one OpenAI conversation from the events of one chain (main or one subagent)."""

    def __init__(self, line: int):
        self.line = line
        self.messages: list[dict] = []
        self.tool_names: dict[str, str] = {}  # tool_use id -> name
        self.used: list[str] = []
        self.open_id: str | None = None  # message.id of the last assistant message, while mergeable
        self.open_texts: list[str] = []

    def assistant(self, msg_id: str | None, blocks: list) -> None:
        texts, calls = [], []
        for b in blocks:
            if not isinstance(b, dict):
                raise BadLine("assistant content block is not an object")
            kind = b.get("type")
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise BadLine("text block without text")
                texts.append(strip_ansi(b["text"]).strip())
            elif kind == "tool_use":
                if not isinstance(b.get("name"), str) or not b.get("id"):
                    raise BadLine("tool_use block without id or name")
                calls.append({"id": str(b["id"]), "type": "function",
                              "function": {"name": b["name"],
                                           "arguments": normalize_arguments(b.get("input") or {})}})
        texts = [t for t in texts if t]
        if msg_id is not None and msg_id == self.open_id:
            target = next(m for m in reversed(self.messages) if m["role"] == "assistant")
            self.open_texts += texts
        else:
            target = {"role": "assistant", "content": ""}
            self.messages.append(target)
            self.open_id, self.open_texts = msg_id, texts
        target["content"] = "\n\n".join(self.open_texts)
        if calls:
            target.setdefault("tool_calls", []).extend(calls)
            for c in calls:
                self.tool_names[c["id"]] = c["function"]["name"]
                if c["function"]["name"] not in self.used:
                    self.used.append(c["function"]["name"])

    def user(self, content: Any, skip) -> None:
        if isinstance(content, str):
            blocks: list = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            blocks = content
        else:
            raise BadLine("user message content is neither a string nor a list")
        texts = []
        for b in blocks:
            if not isinstance(b, dict):
                raise BadLine("user content block is not an object")
            if b.get("type") == "tool_result":
                tid = b.get("tool_use_id")
                if not isinstance(tid, str) or tid not in self.tool_names:
                    skip(f"tool_result for unknown tool_use_id {tid!r}")
                    continue
                self.messages.append({"role": "tool", "tool_call_id": tid,
                                      "name": self.tool_names[tid],
                                      "content": _claude_result_text(b.get("content"))})
            elif b.get("type") == "text" and isinstance(b.get("text"), str):
                texts.append(strip_ansi(b["text"]))
        if texts:
            self.messages.append({"role": "user", "content": "\n".join(texts)})
            self.open_id = None  # a user turn ends any mergeable assistant message


def _claude_result_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return strip_ansi(content)
    if isinstance(content, list):
        return strip_ansi("\n".join(b["text"] for b in content
                                    if isinstance(b, dict) and isinstance(b.get("text"), str)))
    raise BadLine("tool_result content is neither a string nor a list")


def _read_claude(source: str, lines: list[str], report: ReadReport) -> Iterator[Conversation]:
    threads: dict[str, _ClaudeThread] = {}
    for no, ev in _json_lines(source, lines, report):
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
            report.skip(source, no, "not an event object with a 'type'")
            continue
        kind = ev["type"]
        if kind not in ("user", "assistant"):
            continue  # progress, system, summary, snapshots, ...: not conversation turns
        msg = ev.get("message")
        if not isinstance(msg, dict) or "content" not in msg:
            report.skip(source, no, f"{kind} event without message.content")
            continue
        chain = f"agent-{ev.get('agentId') or 'sidechain'}" if ev.get("isSidechain") else "main"
        thread = threads.get(chain)
        if thread is None:
            thread = threads[chain] = _ClaudeThread(no)
        try:
            if kind == "assistant":
                if not isinstance(msg["content"], list):
                    raise BadLine("assistant message content is not a list of blocks")
                thread.assistant(msg.get("id"), msg["content"])
            else:
                thread.user(msg["content"], lambda reason: report.skip(source, no, reason))
        except BadLine as e:
            report.skip(source, no, str(e))
    for chain, thread in threads.items():
        # an assistant message made only of thinking blocks leaves nothing to learn from
        thread.messages = [m for m in thread.messages
                           if m["role"] != "assistant" or m["content"] or m.get("tool_calls")]
        if not thread.messages:
            continue
        tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                 for n in thread.used]
        yield Conversation(messages=thread.messages, tools=tools, source=source, line=thread.line,
                           id="" if chain == "main" else f"{source}#{chain}")
