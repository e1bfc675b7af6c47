"""The target's chat format: render conversations as the model sees them, parse its tool calls back.

Contract: `ChatFormat.for_tokenizer(tok)` uses the tokenizer's own chat template when it has one
that mentions `tools`; otherwise Sailfish's built-in Gemma 4 format below. Either way:
`render_prompt(messages, tools, tool_choice)` is the text before the next assistant turn (generation
prompt included); `assistant_turns(messages, tools)` gives, per assistant message, (prompt, generated)
with prompt + generated a prefix of the whole rendered conversation; `turn_token_ids` gives the
same as token ids; `parse_generated` / `ToolCallStreamParser` turn generated text back into
content plus OpenAI-shaped tool calls (`{"name", "arguments": JSON string}`), a call once it is whole;
`ToolCallStreamer` does it as the text is generated (what the server streams): a call starts once its
name is complete and its arguments follow as JSON fragments whose concatenation is the same
`arguments` text. `ThinkingStreamParser` (which `parse_generated` applies first, and the server runs
before `ToolCallStreamer`, which then sees content segments only) separates the model's thinking from
its content (see "Thinking" below).

tool_choice "required" / {"name": NAME} is ENFORCED in the built-in format: the prompt ends with
`forced_call(tool_choice)` (`<|tool_call>call:`, resp. `<|tool_call>call:NAME{`), and
`ToolCallStreamParser(forced_call(...))` parses what is generated after it. With a chat template
the call is only requested, by a system message.

Built-in Gemma 4 rendering rules (all of them live in this module; `_render` applies them):
- The text starts with the tokenizer's BOS string (`<bos>`); tokenize rendered text with
  `add_special_tokens=False` so it is not doubled.
- System turn, when there is a system message or any tool:
  `<|turn>system\n` + system text + one `<|tool>declaration:NAME{description:<|"|>D<|"|>,`
  `parameters:P}<tool|>` per tool + `<turn|>\n`. Several system messages are joined with "\n\n".
- User turn: `<|turn>user\n` + text + `<turn|>\n`.
- Model turn: `<|turn>model\n` + content + one `<|tool_call>call:NAME{ARGS}<tool_call|>` per
  call. Tool results that follow stay inside the same model turn, each as
  `<|tool_response>response:NAME{RESULT}<tool_response|>`; an assistant message right after
  them continues the same model turn (no new `<|turn>model\n`). The model turn is closed with
  `<turn|>\n` before the next user/system message, before an assistant message that follows an
  assistant message directly, and at the end.
- Values (schemas, arguments, results) use one syntax: objects `{key:value,...}` with bare
  keys in their original order, arrays `[a,b]`, strings `<|"|>text<|"|>` (no escaping), numbers,
  `true`/`false`/`null` bare. A tool result that is not a JSON object becomes
  `{value:...}` (a non-JSON string as a string); arguments that are not a JSON object likewise.
- What the model generates for an assistant message is its content and calls plus the marker
  that ends generation there: `<|tool_response>` when tool results follow, else `<turn|>`.
  The prompt before a continuation ends right after `<tool_response|>`.
- Thinking: see below. An assistant message's `reasoning_content` (or vLLM's `reasoning`) is rendered
  as `<|channel>thought\n` + text + `\n<channel|>` at the start of its generated part, only when
  the message has tool calls and comes after the last user message (a tool loop still in progress);
  every other assistant message's reasoning is dropped. Content holding channel markup is stripped
  of it as the template's `strip_thinking` macro does (each `<|channel>...<channel|>` removed, the
  rest trimmed); content without it is rendered as it is. The generation prompt is not followed by
  the template's empty `<|channel>thought\n<channel|>` (its "thinking off" switch): Sailfish's prompt
  for the next turn stays `<|turn>model\n`, as before.

Thinking (Gemma 4's thinking channel). The model writes `<|channel>thought\n` + thinking +
`<channel|>` (its own tokens `<|channel>` and `<channel|>`, channel name `thought`), then its answer
or calls. `ThinkingStreamParser` splits generated text into reasoning and content segments: the
`thought\n` label and one newline right before `<channel|>` are markup (the template writes both), a
thinking segment still open at the end is reasoning (never content), and partial markers are held
back as `ToolCallStreamParser` holds back a partial call marker. A `<channel|>` without a preceding
`<|channel>` is content. Sources: vLLM's `vllm/reasoning/gemma4_reasoning_parser.py` (start token
`<|channel>`, end token `<channel|>`, the `thought\n` label stripped) and the Gemma 4 chat template
vLLM ships as `examples/tool_chat_template_gemma4.jinja` (its reasoning gate `loop.index0 >
ns_turn.last_user_idx and message.get('tool_calls')`, its `strip_thinking` macro; some later checkpoint
templates gate differently, with a `preserve_thinking` option: not followed here).
"""
from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass, field
from typing import Any

TURN_OPEN, TURN_CLOSE = "<|turn>", "<turn|>"
TOOL_OPEN, TOOL_CLOSE = "<|tool>", "<tool|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
RESP_OPEN, RESP_CLOSE = "<|tool_response>", "<tool_response|>"
QUOTE = '<|"|>'
THINK_OPEN, THINK_CLOSE = "<|channel>", "<channel|>"
THOUGHT_LABEL = "thought\n"  # the channel's name line, right after THINK_OPEN
REASONING, CONTENT = "reasoning", "content"  # the kinds of ThinkingStreamParser's segments
END_MARKERS = (TURN_CLOSE, RESP_OPEN, "<end_of_turn>", "<eos>")

# ---------------------------------------------------------------- the value syntax


MAX_VALUE_DEPTH = 64  # deeper values are refused (ValueError) instead of exhausting the recursion limit


def format_value(value: Any, depth: int = 0) -> str:
    if depth > MAX_VALUE_DEPTH:
        raise ValueError(f"a value nested deeper than {MAX_VALUE_DEPTH} levels")
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_value(v, depth + 1)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v, depth + 1) for v in value) + "]"
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def json_depth(value: Any, limit: int = MAX_VALUE_DEPTH) -> int:
    """Nesting depth of decoded JSON (iterative: no recursion), counted up to `limit` + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _as_object(text: str | None) -> dict:
    """A JSON-object string as a dict; anything else (or JSON nested deeper than MAX_VALUE_DEPTH)
    wrapped as {"value": ...}."""
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return {"value": text}
    if json_depth(parsed) >= MAX_VALUE_DEPTH:
        return {"value": text}
    return parsed if isinstance(parsed, dict) else {"value": parsed}


def _bare_value(raw: str) -> Any:
    """An unquoted value (the text up to the next `,`, `}` or `]`): a JSON literal or number, else the
    bare word itself as a string; ValueError when it is empty."""
    raw = raw.strip()
    if raw in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[raw]
    try:
        return json.loads(raw)
    except ValueError:
        if not raw:
            raise ValueError("empty value") from None
        return raw  # a bare word the model left unquoted: keep it as a string


class _ValueParser:
    """Parses the value syntax at `pos`; raises ValueError on anything malformed or truncated."""

    _BARE_END = re.compile(r"[,}\]]")

    def __init__(self, text: str, pos: int = 0):
        self.text, self.pos = text, pos

    def value(self) -> Any:
        t = self.text
        if t.startswith(QUOTE, self.pos):
            end = t.find(QUOTE, self.pos + len(QUOTE))
            if end < 0:
                raise ValueError("unterminated string")
            s = t[self.pos + len(QUOTE):end]
            self.pos = end + len(QUOTE)
            return s
        if t.startswith("{", self.pos):
            return self.obj()
        if t.startswith("[", self.pos):
            self.pos += 1
            out = []
            if t.startswith("]", self.pos):
                self.pos += 1
                return out
            while True:
                out.append(self.value())
                if t.startswith(",", self.pos):
                    self.pos += 1
                elif t.startswith("]", self.pos):
                    self.pos += 1
                    return out
                else:
                    raise ValueError("bad array")
        m = self._BARE_END.search(t, self.pos)
        if m is None:
            raise ValueError("truncated value")
        raw = t[self.pos:m.start()]
        self.pos = m.start()
        return _bare_value(raw)

    def obj(self) -> dict:
        t = self.text
        if not t.startswith("{", self.pos):
            raise ValueError("expected {")
        self.pos += 1
        out: dict = {}
        if t.startswith("}", self.pos):
            self.pos += 1
            return out
        while True:
            colon = t.find(":", self.pos)
            if colon < 0:
                raise ValueError("truncated key")
            key = t[self.pos:colon].strip()
            if not key or any(c in key for c in "{}[],<>"):
                raise ValueError("bad key")
            self.pos = colon + 1
            out[key] = self.value()
            if t.startswith(",", self.pos):
                self.pos += 1
            elif t.startswith("}", self.pos):
                self.pos += 1
                return out
            else:
                raise ValueError("bad object")


def parse_value_object(text: str) -> dict:
    p = _ValueParser(text)
    obj = p.obj()
    if p.pos != len(text):
        raise ValueError("trailing text")
    return obj


# ---------------------------------------------------------------- parsing generated text

_CALL_HEAD = re.compile(r"call:([^{}<>\s]+)\{")


@dataclass
class ParsedTurn:
    content: str
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments": JSON string}
    reasoning: str = ""  # the thinking channel's text (ThinkingStreamParser), "" when the model did not think


def _parse_call(body: str) -> dict | None:
    """`call:NAME{...}` (the text between the call markers) -> {"name", "arguments"}, or None."""
    m = _CALL_HEAD.match(body)
    if not m:
        return None
    try:
        args = parse_value_object(body[m.end() - 1:])
    except ValueError:
        return None
    return {"name": m.group(1), "arguments": json.dumps(args, ensure_ascii=False)}


def _strip_end_marker(text: str) -> str:
    for marker in END_MARKERS:
        if text.endswith(marker):
            return text[: -len(marker)]
    return text


def parse_generated(text: str) -> ParsedTurn:
    """Generated model text -> content + tool calls + reasoning. A truncated or garbled call stays
    content (markup cut off before a call's name is complete is dropped); thinking never does
    (ThinkingStreamParser)."""
    thinking = ThinkingStreamParser()
    segments = thinking.feed(_strip_end_marker(text)) + thinking.finish()
    reasoning = "".join(part for kind, part in segments if kind == REASONING)
    parser = ToolCallStreamParser()
    content, calls = parser.feed("".join(part for kind, part in segments if kind == CONTENT))
    rest, more = parser.finish()
    return ParsedTurn(content=content + rest, tool_calls=calls + more, reasoning=reasoning)


class ThinkingStreamParser:
    """Feed text deltas; get the (kind, text) segments they complete back, kind REASONING or CONTENT,
    in order, none empty.

    `<|channel>` opens a thinking segment and `<channel|>` closes it (the module docstring, "Thinking").
    Text that could still become `<|channel>` is held back in content, and text that could still
    become the closing markup (`\n<channel|>`) or the `thought\n` label in thinking, so no markup is
    ever released. `finish()` flushes what is held: in content as content (an unfinished marker is
    not markup), in thinking as reasoning (thinking cut off stays reasoning; a bare label fragment is
    dropped). Then the parser is ready for a new text.
    """

    _CLOSES = ("\n" + THINK_CLOSE, THINK_CLOSE)  # the newline before the close marker is the template's

    def __init__(self) -> None:
        self._buf = ""
        self._thinking = False       # inside <|channel>...<channel|>
        self._label_pending = False  # right after <|channel>: the `thought\n` label may still come

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self._buf += delta
        segments: list[tuple[str, str]] = []
        while True:
            if not self._thinking:
                start = self._buf.find(THINK_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buf, THINK_OPEN)
                    _add_segment(segments, CONTENT, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return segments
                _add_segment(segments, CONTENT, self._buf[:start])
                self._buf = self._buf[start + len(THINK_OPEN):]
                self._thinking = self._label_pending = True
                continue
            if self._label_pending:
                if self._buf.startswith(THOUGHT_LABEL):
                    self._buf = self._buf[len(THOUGHT_LABEL):]
                elif THOUGHT_LABEL.startswith(self._buf):  # too short to tell yet
                    return segments
                self._label_pending = False
            end = self._buf.find(THINK_CLOSE)
            if end < 0:
                keep = max(_partial_suffix(self._buf, close) for close in self._CLOSES)
                _add_segment(segments, REASONING, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return segments
            thought = self._buf[:end]
            _add_segment(segments, REASONING, thought[:-1] if thought.endswith("\n") else thought)
            self._buf = self._buf[end + len(THINK_CLOSE):]
            self._thinking = False

    def finish(self) -> list[tuple[str, str]]:
        rest, kind = self._buf, REASONING if self._thinking else CONTENT
        if self._thinking and self._label_pending and THOUGHT_LABEL.startswith(rest):
            rest = ""  # only (part of) the label came: markup, not thought
        self._buf, self._thinking, self._label_pending = "", False, False
        segments: list[tuple[str, str]] = []
        _add_segment(segments, kind, rest)
        return segments


def _add_segment(segments: list[tuple[str, str]], kind: str, text: str) -> None:
    """Append (kind, text), merged into the last segment when it is of the same kind; "" is skipped."""
    if not text:
        return
    if segments and segments[-1][0] == kind:
        segments[-1] = (kind, segments[-1][1] + text)
    else:
        segments.append((kind, text))


def strip_thinking(content: str) -> str:
    """Assistant content without channel markup, as the Gemma 4 template's `strip_thinking` macro
    renders it: of each part before a `<channel|>`, what precedes its `<|channel>`; the result trimmed.
    Content without markup is returned unchanged (the built-in format never trimmed it)."""
    if THINK_OPEN not in content and THINK_CLOSE not in content:
        return content
    parts = content.split(THINK_CLOSE)
    return "".join(part.split(THINK_OPEN)[0] for part in parts).strip()


def _thinking_text(message: dict, after_last_user: bool) -> str:
    """The thinking channel an assistant message renders: its reasoning, only in a tool loop still in
    progress (tool calls, after the last user message), as the Gemma 4 template gates it; else ""."""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if not reasoning or not after_last_user or not message.get("tool_calls"):
        return ""
    return f"{THINK_OPEN}{THOUGHT_LABEL}{reasoning}\n{THINK_CLOSE}"


class ToolCallStreamParser:
    """Feed text deltas; get (content delta, completed tool calls) back (`ToolCallStreamer` streams a
    call's arguments as they arrive instead).

    Text that could still become `<|tool_call>` is held back, and so is an open call until its
    `<tool_call|>` arrives, so no partial markup is emitted as content. A call that does not
    parse is released as content. `finish()` flushes what is held (an unclosed call as content), save
    markup cut off before a call's name was complete (from "<|" on), which is dropped.
    `forced` is the part of the model turn the prompt already holds (`ChatFormat.forced_call`): it is
    parsed as the start of the generated text, so a forced call left unclosed is released as content too.
    """

    def __init__(self, forced: str = "") -> None:
        self._buf = forced

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self._buf += delta
        content: list[str] = []
        calls: list[dict] = []
        while True:
            start = self._buf.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, CALL_OPEN)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            end = self._buf.find(CALL_CLOSE, start + len(CALL_OPEN))
            if end < 0:
                content.append(self._buf[:start])
                self._buf = self._buf[start:]
                break
            content.append(self._buf[:start])
            call = _parse_call(self._buf[start + len(CALL_OPEN):end])
            if call is None:
                content.append(self._buf[start:end + len(CALL_CLOSE)])
            else:
                calls.append(call)
            self._buf = self._buf[end + len(CALL_CLOSE):]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        rest, self._buf = self._buf, ""
        return ("" if _markup_cut_off(rest) else rest), []


def _markup_cut_off(held: str) -> bool:
    """Whether text held back at the end of generation is call markup cut off before the call's name
    was complete: the start of `<|tool_call>` from "<|" on (a lone "<" may be text), or the marker and
    a prefix of `call:NAME{`. Such text is neither content nor a call: both parsers drop it."""
    if held.startswith(CALL_OPEN):
        return _could_become_call_head(held[len(CALL_OPEN):])
    return len(held) >= 2 and CALL_OPEN.startswith(held)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ---------------------------------------------------------------- streaming calls as they are generated


@dataclass(frozen=True)
class CallStarted:
    """A tool call's name is complete (`<|tool_call>call:NAME{` was generated); its arguments follow."""
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next fragment of the open call's arguments, JSON text (never empty)."""
    text: str


@dataclass(frozen=True)
class CallEnded:
    """The open call is over. `arguments` is the concatenation of its ArgumentsDelta fragments.
    `complete`: its top-level object closed, so `arguments` is valid JSON. An incomplete call (cut off
    by the end of generation, or a body that broke the value syntax) has the JSON prefix converted up
    to there, which is not valid JSON: it is never made to look like a finished call."""
    name: str
    arguments: str
    complete: bool


StreamEvent = str | CallStarted | ArgumentsDelta | CallEnded


class _ArgumentsConverter:
    """The value syntax of a call body (from its opening `{`) converted to JSON text as it arrives.

    `feed(text)` returns the JSON that is certain so far: structure as soon as it opens or closes,
    a key together with the start of its value, string contents as they arrive (escaped per
    character, holding back only a partial `<|"|>`), a bare value (number, literal, bare word) once
    the character ending it arrives, separators with the element that follows them. So the prefix
    emitted never ends in a dangling key or separator. The rules are `_ValueParser`'s, and for a body
    `parse_value_object` accepts the emitted text is exactly `json.dumps(obj, ensure_ascii=False)`, the
    arguments `parse_generated` gives, except that a key repeated in one object is repeated in the
    JSON too (JSON parsers keep its last value, as the dict does). `done` is set when the top-level
    object closes (text after it is not consumed), `broken` when the body breaks the syntax or nests
    deeper than MAX_VALUE_DEPTH; `end()` says the body is over (it breaks one that has not closed).
    """

    _KEY_FORBIDDEN = frozenset("{}[],<>")

    def __init__(self) -> None:
        self._buf = ""
        self._stack: list[list[str]] = []  # open containers: [kind "obj"|"arr", what comes next]
        self._in_string = False
        self._pending = ""  # separator and key, emitted with the next value's start
        self._top_opened = False
        self.done = self.broken = False

    def feed(self, text: str) -> str:
        self._buf += text
        out: list[str] = []
        pos = 0
        while not (self.done or self.broken):
            step = self._step(pos, out)
            if step is None:
                break
            pos = step
        self._buf = self._buf[pos:]
        return "".join(out)

    def end(self) -> None:
        if not self.done:
            self.broken = True

    def _step(self, pos: int, out: list[str]) -> int | None:
        """Consume one token at `pos`, appending its JSON to `out`; the new position, or None when more
        text is needed (or the body just broke)."""
        b = self._buf
        if self._in_string:
            end = b.find(QUOTE, pos)
            if end < 0:
                stop = len(b) - _partial_suffix(b[pos:], QUOTE)
                if stop > pos:
                    out.append(_json_string_chars(b[pos:stop]))
                return stop if stop > pos else None
            out.append(_json_string_chars(b[pos:end]) + '"')
            self._in_string = False
            self._value_done()
            return end + len(QUOTE)
        if pos >= len(b):
            return None
        if not self._top_opened:
            if b[pos] != "{":
                self.broken = True
                return None
            self._top_opened = True
            return self._open(pos, out, "obj")
        kind, expect = self._stack[-1]
        if expect == "after":
            closer = "}" if kind == "obj" else "]"
            if b[pos] == ",":
                self._stack[-1][1] = "key" if kind == "obj" else "value"
                self._pending = ", "
                return pos + 1
            if b[pos] == closer:
                return self._close(pos, out, closer)
            self.broken = True
            return None
        if expect == "first" and b[pos] == ("}" if kind == "obj" else "]"):
            return self._close(pos, out, b[pos])
        if kind == "obj" and expect in ("first", "key"):
            return self._key(pos)
        return self._value(pos, out)

    def _key(self, pos: int) -> int | None:
        b = self._buf
        colon = b.find(":", pos)
        segment = b[pos:] if colon < 0 else b[pos:colon]
        if self._KEY_FORBIDDEN.intersection(segment):
            self.broken = True
            return None
        if colon < 0:
            return None
        key = segment.strip()
        if not key:
            self.broken = True
            return None
        self._pending += json.dumps(key, ensure_ascii=False) + ": "
        self._stack[-1][1] = "value"
        return colon + 1

    def _value(self, pos: int, out: list[str]) -> int | None:
        b = self._buf
        rest = b[pos:pos + len(QUOTE)]
        if rest == QUOTE:
            out.append(self._pending + '"')
            self._pending, self._in_string = "", True
            return pos + len(QUOTE)
        if QUOTE.startswith(rest):  # a partial `<|"|>` (or a bare word starting so): wait
            return None
        if b[pos] in "{[":
            return self._open(pos, out, "obj" if b[pos] == "{" else "arr")
        m = _ValueParser._BARE_END.search(b, pos)
        if m is None:
            return None
        try:
            value = _bare_value(b[pos:m.start()])
        except ValueError:
            self.broken = True
            return None
        out.append(self._pending + json.dumps(value, ensure_ascii=False))
        self._pending = ""
        self._value_done()
        return m.start()

    def _open(self, pos: int, out: list[str], kind: str) -> int | None:
        if len(self._stack) >= MAX_VALUE_DEPTH:
            self.broken = True
            return None
        out.append(self._pending + self._buf[pos])
        self._pending = ""
        self._stack.append([kind, "first"])
        return pos + 1

    def _close(self, pos: int, out: list[str], closer: str) -> int:
        out.append(closer)
        self._stack.pop()
        self._value_done()
        return pos + 1

    def _value_done(self) -> None:
        if self._stack:
            self._stack[-1][1] = "after"
        else:
            self.done = True


def _json_string_chars(text: str) -> str:
    """`text` escaped as the inside of a JSON string (escaping is per character, so pieces concatenate)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class ToolCallStreamer:
    """Feed text deltas; get `StreamEvent`s back as soon as they are certain: content (str), and per
    call `CallStarted` once its name is complete, `ArgumentsDelta` fragments as its body is generated
    (see `_ArgumentsConverter`), `CallEnded` when its object closes (or it is cut off or breaks).

    Content is held back only while it could still become `<|tool_call>`. Text after `<|tool_call>`
    that cannot become `call:NAME{` is content, through its `<tool_call|>`, as `parse_generated` has it.
    Generation ending inside a marker (from "<|" of `<|tool_call>` on) or before a call's name is
    complete drops that markup: it is neither content nor a call.
    Once a call has started it is committed (a stream cannot take it back): a body that breaks the
    value syntax, or generation ending before the object closes, ends the call incomplete
    (`CallEnded.complete` False, its arguments the JSON converted so far); the rest of its text through
    `<tool_call|>` is dropped, as is any text between the object's closing `}` and `<tool_call|>`.
    For every call `parse_generated` accepts, the events carry the same content and the same arguments
    text (`_ArgumentsConverter` says the one exception). `forced` is the part of the model turn the
    prompt already holds (`ChatFormat.forced_call`), parsed as the start of the generated text.
    `finish()` flushes what is held and ends an open call.
    """

    _TEXT, _HEAD, _NOT_A_CALL, _BODY, _AFTER_CALL = range(5)

    def __init__(self, forced: str = "") -> None:
        self._buf = ""
        self._state = self._TEXT
        self._name = ""
        self._arguments: list[str] = []
        self._converter: _ArgumentsConverter | None = None
        self._held_events: list[StreamEvent] = []
        self._held_events = self.feed(forced)

    def feed(self, delta: str) -> list[StreamEvent]:
        events, self._held_events = self._held_events, []
        self._buf += delta
        while self._step(events):
            pass
        return _joined_text(events)

    def finish(self) -> list[StreamEvent]:
        events, self._held_events = self._held_events, []
        rest, self._buf = self._buf, ""
        if self._state == self._TEXT:  # held back as the start of `<|tool_call>`
            events.append("" if _markup_cut_off(rest) else rest)
        elif self._state == self._NOT_A_CALL:
            events.append(rest)
        # _HEAD: `<|tool_call>` and a prefix of `call:NAME{` (the name unfinished): markup cut off
        # (_markup_cut_off), dropped
        elif self._state == self._BODY:
            self._to_converter(rest, events)
            if self._state == self._BODY:
                self._converter.end()
                self._end_call(events)
        self._state = self._TEXT
        return _joined_text(events)

    def _step(self, events: list[StreamEvent]) -> bool:
        """Advance through the buffer in the current state; whether to go on."""
        b = self._buf
        if self._state == self._TEXT:
            start = b.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(b, CALL_OPEN)
                events.append(b[: len(b) - keep])
                self._buf = b[len(b) - keep:]
                return False
            events.append(b[:start])
            self._buf, self._state = b[start + len(CALL_OPEN):], self._HEAD
            return True
        if self._state == self._HEAD:
            m = _CALL_HEAD.match(b)
            if m:
                self._name, self._arguments = m.group(1), []
                self._converter = _ArgumentsConverter()
                events.append(CallStarted(self._name))
                self._buf, self._state = b[m.end() - 1:], self._BODY
                return True
            if _could_become_call_head(b):
                return False
            events.append(CALL_OPEN)
            self._state = self._NOT_A_CALL
            return True
        if self._state in (self._NOT_A_CALL, self._AFTER_CALL):
            end = b.find(CALL_CLOSE)
            cut = end + len(CALL_CLOSE) if end >= 0 else len(b) - _partial_suffix(b, CALL_CLOSE)
            if self._state == self._NOT_A_CALL:
                events.append(b[:cut])
            self._buf = b[cut:]
            if end >= 0:
                self._state = self._TEXT
            return end >= 0
        end = b.find(CALL_CLOSE)  # _BODY
        cut = end if end >= 0 else len(b) - _partial_suffix(b, CALL_CLOSE)
        self._buf = b[cut:]
        self._to_converter(b[:cut], events)
        if self._state == self._BODY and end >= 0:  # the body is over before its object closed
            self._converter.end()
            self._end_call(events)
        return self._state != self._BODY

    def _to_converter(self, text: str, events: list[StreamEvent]) -> None:
        fragment = self._converter.feed(text)
        if fragment:
            self._arguments.append(fragment)
            events.append(ArgumentsDelta(fragment))
        if self._converter.done or self._converter.broken:
            self._end_call(events)

    def _end_call(self, events: list[StreamEvent]) -> None:
        events.append(CallEnded(self._name, "".join(self._arguments), self._converter.done))
        self._state, self._converter = self._AFTER_CALL, None


def _could_become_call_head(text: str) -> bool:
    """Whether `text` (what follows `<|tool_call>`) is a prefix of some `call:NAME{`."""
    if len(text) <= len("call:"):
        return "call:".startswith(text)
    return text.startswith("call:") and re.fullmatch(r"[^{}<>\s]*", text[len("call:"):]) is not None


def _joined_text(events: list[StreamEvent]) -> list[StreamEvent]:
    """Adjacent content pieces joined, empty ones dropped."""
    out: list[StreamEvent] = []
    for event in events:
        if isinstance(event, str):
            if not event:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += event
                continue
        out.append(event)
    return out


# ---------------------------------------------------------------- rendering


def _tool_function(tool: dict) -> dict:
    return tool.get("function", tool) if isinstance(tool, dict) else {}


def _declaration(tool: dict) -> str:
    """A tool's declaration. Traces repeat the same tool schemas on every request, and rendering a
    schema is a deep Python recursion, so declarations are cached by the tool's JSON text (json.dumps
    runs in C, several times faster than format_value)."""
    try:
        key = json.dumps(tool)
    except (TypeError, ValueError, RecursionError):  # not JSON-shaped: render it directly
        return _render_declaration(tool)
    hit = _DECLARATIONS.get(key)
    if hit is None:
        hit = _render_declaration(tool)
        _DECLARATIONS.put(key, hit)
    return hit


class _ByteBoundedCache:
    """An LRU of rendered declarations bounded in bytes (keys and values counted as characters).
    A declaration larger than `max_entry` is never cached: one huge schema (a request likely to be
    refused for its length anyway) cannot evict the useful ones or hold memory."""

    def __init__(self, max_bytes: int, max_entry: int):
        self.max_bytes, self.max_entry = max_bytes, max_entry
        self.entries: "collections.OrderedDict[str, str]" = collections.OrderedDict()
        self.bytes = 0

    def get(self, key: str) -> str | None:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key: str, value: str) -> None:
        size = len(key) + len(value)
        if size > self.max_entry or key in self.entries:
            return
        self.entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            old_key, old_value = self.entries.popitem(last=False)
            self.bytes -= len(old_key) + len(old_value)


# Real traces repeat a few hundred tool schemas; 16 MB holds them, 256 KB is a very large schema.
_DECLARATIONS = _ByteBoundedCache(16 * 2**20, 256 * 2**10)


def _render_declaration(tool: dict) -> str:
    fn = _tool_function(tool)
    body = {"description": fn.get("description", ""),
            "parameters": fn.get("parameters") or {"type": "object"}}
    return f"{TOOL_OPEN}declaration:{fn.get('name', '')}{format_value(body)}{TOOL_CLOSE}"


def _call_text(call: dict) -> str:
    fn = call.get("function", call)
    return f"{CALL_OPEN}call:{fn['name']}{format_value(_as_object(fn.get('arguments')))}{CALL_CLOSE}"


def _response_text(name: str, content: str) -> str:
    return f"{RESP_OPEN}response:{name}{format_value(_as_object(content))}{RESP_CLOSE}"


def _render(bos: str, messages: list[dict], tools: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Built-in Gemma 4 rendering of a whole conversation.

    Returns the text (any open model turn closed at the end) and, per assistant message, the
    (start, end) character offsets of what the model generates for it, end marker included.
    """
    out = [bos]
    spans: list[tuple[int, int]] = []
    pos = len(bos)

    def emit(s: str) -> None:
        nonlocal pos
        out.append(s)
        pos += len(s)

    systems = [m.get("content") or "" for m in messages if m["role"] == "system"]
    if systems or tools:
        emit(f"{TURN_OPEN}system\n" + "\n\n".join(systems)
             + "".join(_declaration(t) for t in tools) + f"{TURN_CLOSE}\n")
    names: dict[str, str] = {}
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    in_model = False  # a model turn is open
    prev = None  # role of the previous rendered message
    pending: int | None = None  # start offset of the assistant message awaiting its end marker
    for index, m in enumerate(messages):
        role = m["role"]
        if role == "system":
            continue
        if role == "tool":
            if pending is not None:
                spans.append((pending, pos + len(RESP_OPEN)))
                pending = None
            if not in_model:  # a tool result without a preceding call: still inside a model turn
                emit(f"{TURN_OPEN}model\n")
                in_model = True
            name = m.get("name") or names.get(m.get("tool_call_id", ""), "unknown")
            emit(_response_text(name, m.get("content") or ""))
        else:
            if in_model and (role == "user" or prev == "assistant"):
                if pending is not None:
                    spans.append((pending, pos + len(TURN_CLOSE)))
                    pending = None
                emit(f"{TURN_CLOSE}\n")
                in_model = False
            if role == "user":
                emit(f"{TURN_OPEN}user\n{m.get('content') or ''}{TURN_CLOSE}\n")
            else:
                if not in_model:
                    emit(f"{TURN_OPEN}model\n")
                    in_model = True
                pending = pos
                emit(_thinking_text(m, index > last_user) + strip_thinking(m.get("content") or ""))
                for call in m.get("tool_calls") or []:
                    names[call.get("id", "")] = call["function"]["name"]
                    emit(_call_text(call))
        prev = role
    if in_model:
        if pending is not None:
            spans.append((pending, pos + len(TURN_CLOSE)))
        emit(f"{TURN_CLOSE}\n")
    return "".join(out), spans


def _generation_prompt(messages: list[dict]) -> str:
    """What opens the next assistant turn after `messages` in the built-in format."""
    last = next((m["role"] for m in reversed(messages) if m["role"] != "system"), None)
    return "" if last == "tool" else f"{TURN_OPEN}model\n"


class ChatFormat:
    def __init__(self, bos: str = "<bos>", tokenizer: Any = None, template_writes_gemma_calls: bool = False):
        self.bos = bos
        self._template_tok = tokenizer  # set only when rendering through the tokenizer's template
        self._template_writes_gemma_calls = template_writes_gemma_calls

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> "ChatFormat":
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = " ".join(str(v) for v in template.values())
        bos = getattr(tokenizer, "bos_token", None) or ""
        if isinstance(template, str) and "tools" in template:
            return cls(bos=bos, tokenizer=tokenizer, template_writes_gemma_calls=CALL_OPEN in template)
        return cls(bos=bos)

    @property
    def uses_template(self) -> bool:
        return self._template_tok is not None

    @property
    def writes_gemma_calls(self) -> bool:
        """Whether the model's calls are in the Gemma 4 call syntax (`<|tool_call>call:NAME{...}`): always
        with the built-in format, and with a chat template that renders calls that way (Gemma 4's own), so
        a grammar can enforce them (server.grammar's tool-call grammar)."""
        return not self.uses_template or self._template_writes_gemma_calls

    def _apply_template(self, messages: list[dict], tools: list[dict], gen: bool) -> str:
        return self._template_tok.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=gen, tokenize=False)

    def render(self, messages: list[dict], tools: list[dict]) -> str:
        """The whole conversation as text."""
        if self.uses_template:
            return self._apply_template(messages, tools, gen=False)
        return _render(self.bos, messages, tools)[0]

    def render_with_spans(self, messages: list[dict], tools: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """Built-in format only: the whole text and each assistant turn's (start, end) offsets."""
        if self.uses_template:
            raise ValueError("render_with_spans is for the built-in format; use assistant_turns")
        return _render(self.bos, messages, tools)

    def forced_call(self, tool_choice: str | dict) -> str:
        """The start of a tool call that ends the prompt to enforce `tool_choice` (see the module
        docstring); "" for "auto" and "none", and always with a chat template."""
        if self.uses_template or tool_choice in ("auto", "none"):
            return ""
        return f"{CALL_OPEN}call:" + (f"{tool_choice['name']}{{" if isinstance(tool_choice, dict) else "")

    def render_prompt(self, messages: list[dict], tools: list[dict], tool_choice: str | dict = "auto") -> str:
        if self.uses_template:
            if tool_choice not in ("auto", "none"):
                name = tool_choice["name"] if isinstance(tool_choice, dict) else None
                ask = f"You must call the tool {name}." if name else "You must call one of the tools."
                messages = [{"role": "system", "content": ask}] + messages
            return self._apply_template(messages, tools, gen=True)
        text, _ = _render(self.bos, messages, tools)
        if messages and messages[-1]["role"] == "tool":
            # the open model turn continues after the tool response: drop the closing marker
            text = text[: -len(f"{TURN_CLOSE}\n")]
        else:
            text += _generation_prompt(messages)
        return text + self.forced_call(tool_choice)

    def assistant_turns(self, messages: list[dict], tools: list[dict]) -> list[tuple[str, str]]:
        if self.uses_template:
            turns = []
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                prompt = self._apply_template(messages[:i], tools, gen=True)
                full = self._apply_template(messages[: i + 1], tools, gen=False)
                if full.startswith(prompt):  # a template that breaks this gives no usable turn
                    turns.append((prompt, full[len(prompt):]))
            return turns
        text, spans = _render(self.bos, messages, tools)
        return [(text[:a], text[a:b]) for a, b in spans]

    def turn_token_ids(self, tokenizer: Any, messages: list[dict],
                       tools: list[dict]) -> list[tuple[list[int], list[int]]]:
        """(context ids, target ids) per assistant turn, with the model's own token boundaries.

        Cost is quadratic in conversation length (each prompt is tokenized); cap long sessions.
        """
        out = []
        for prompt, generated in self.assistant_turns(messages, tools):
            ctx = tokenizer.encode(prompt, add_special_tokens=False)
            full = tokenizer.encode(prompt + generated, add_special_tokens=False)
            if full[: len(ctx)] == ctx:
                target = full[len(ctx):]
            else:  # the boundary merged into one token: tokenize the generated part alone
                target = tokenizer.encode(generated, add_special_tokens=False)
            out.append((ctx, target))
        return out

    @staticmethod
    def stop_strings() -> list[str]:
        return list(END_MARKERS)

    @staticmethod
    def stop_token_ids(tokenizer: Any) -> set[int]:
        ids: set[int] = set()
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(i) for i in eos)
        vocab = tokenizer.get_vocab()
        for s in ("<end_of_turn>", TURN_CLOSE, RESP_OPEN):
            if s in vocab:
                ids.add(vocab[s])
        return ids

    @staticmethod
    def parse_generated(text: str) -> ParsedTurn:
        return parse_generated(text)
