"""The Anthropic Messages API over the chat machinery, so that Claude Code can use Sailfish
(`ANTHROPIC_BASE_URL=http://127.0.0.1:22343`).

Contract: `routes(service, read_json)` gives POST /v1/messages and POST /v1/messages/count_tokens.
A request is translated by `parse_request` into the `server.protocol.ChatCompletionRequest` the OpenAI
route builds, and served by the same generation path (`Service.chat_events`); nothing here generates.
The answer comes back in Anthropic's shapes: a `message` object, or with `stream: true` the SSE
sequence `message_start`, per block `content_block_start` / `content_block_delta` (`thinking_delta`,
`text_delta`, `input_json_delta`) / `content_block_stop`, `message_delta` (stop_reason, stop_sequence, usage),
`message_stop`. A whole answer is the fold of that same event sequence, so streamed and whole
answers cannot differ. Every error on these routes is `{"type": "error", "error": {"type", "message"}}`
(`error_body`) with its status; once a stream has begun, an error is its last event (`event: error`).
`serves(path)` says whether a path is answered in this shape (app.py uses it for 401 and 404 too).

Translation, field by field:
- `messages`: roles user and assistant, and system (Claude Code sends system messages inside
  `messages`; like a top-level `system` they join the system turn). Consecutive messages of one
  role are one turn, as in Anthropic's API. Content is a string or blocks: `text`; `tool_use`
  (assistant: an OpenAI tool call whose arguments are the JSON of `input`); `tool_result` (user:
  a tool message; content a string or text blocks; `is_error: true` renders the result as
  `{"error": TEXT}`, so the model sees that the call failed); `thinking` blocks of an assistant turn
  become its `reasoning_content` (joined with a blank line), which the chat format renders back only
  in a tool loop still in progress and drops for earlier turns, as Gemma 4's template does (and as
  Anthropic drops earlier turns' thinking); `redacted_thinking` (opaque data) is dropped. `image`,
  `document` and every other block type get a 400. Several text blocks of one turn
  are joined with a blank line. A final assistant message (prefill) gets a 400: Sailfish cannot
  continue a partial answer.
- `system`: a string or text blocks. A block starting `x-anthropic-billing-header:` is Claude Code's
  per-request attribution line, not an instruction; it changes on every request and, at the head of
  the prompt, would defeat the prefix cache, so it is dropped.
- `tools`: custom tools (`name`, `description`, `input_schema`; `type` "custom" or absent). `strict`
  is honoured as on the OpenAI route (calls follow the schema under tool_choice auto too). Server
  tools (`web_search_...`, `bash_...`, ...), `defer_loading`, `input_examples` and
  `allowed_callers` other than ["direct"] get a 400. `eager_input_streaming` is accepted: a tool's
  input always streams as it is generated, one `input_json_delta` per fragment.
- `tool_choice`: auto -> "auto", any -> "required", tool -> the named function, none -> "none"
  (enforced as server.serving describes). `disable_parallel_tool_use: true` is enforced (one call at
  most) with any, tool, or auto with strict tools, and gets a 400 with plain auto (it cannot be
  enforced there), as `parallel_tool_calls: false` on the OpenAI route.
- `max_tokens` is required (count_tokens excepted) and at least 1; `stop_sequences`, `temperature`
  (0-1, as Anthropic's), `top_p`, `top_k` (not negative) and `stream` mean what they mean on the OpenAI route, checked by the same
  server.protocol readers (its sampling ranges; a field left out takes the model's defaults).
- `thinking`: {"type": "disabled"} and {"type": "adaptive"} (the model decides whether to think) are
  accepted; {"type": "enabled"} (a thinking budget) and every other type get a 400, since a budget
  cannot be enforced and the prompt has no switch that turns thinking on (in Claude Code:
  MAX_THINKING_TOKENS=0). Whatever the model does think (Gemma 4's thinking channel) is answered as
  `thinking` blocks (`signature` ""), before the text and tool_use blocks it precedes.
- Accepted and without effect: `metadata` (`user_id`, a string, alone); `cache_control` (top level and on any block or tool:
  Sailfish's prefix cache is automatic); `service_tier` (there is one tier); `output_config.effort`
  (a hint; `output_config.format` gets a 400); `context_management` whose edits all clear thinking
  (there is none to clear; other edits get a 400). The `anthropic-version` and `anthropic-beta`
  headers are accepted with any value. Any other field gets a 400.
- `stop_reason`: "tool_use" when the answer has tool calls, all finished, "max_tokens" at the length limit,
  "stop_sequence" (with `stop_sequence`) when one of the request's stop sequences ended it, else
  "end_turn". Under tool_choice any / tool (or strict tools) stop sequences end the text, not the
  enforced call: inside it they are not matched (server/engine.py `first_stop`); under auto a call
  they match in is cut and answered as cut ("stop_sequence"). A tool_use block cut off by max_tokens streams its unfinished JSON; its `input` in the
  whole message is what Anthropic's SDK reads from that partial JSON (`partial_json_object`: an
  unfinished string is dropped with its key, open brackets are closed), so both agree. `usage`: `input_tokens` the prompt tokens computed, `cache_read_input_tokens` those
  reused from the prefix cache, `cache_creation_input_tokens` 0 (keeping a prefix costs nothing
  extra), `output_tokens`; `sailfish` carries the drafting figures of the OpenAI usage. In
  `message_start` the whole prompt is counted as `input_tokens`; `message_delta` has the final split.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from server.protocol import (APIError, ChatCompletionRequest, _bad, _max_tokens, _opt, _sampling, parse_messages,
                             parse_tool_choice, parse_tools, strict_calls)
from server.serving import Finish, Reasoning, Service, ToolCallDelta, ToolCallEnd, ToolCallStart

log = logging.getLogger("sailfish.anthropic")
MESSAGES_PATH = "/v1/messages"
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_BLOCK_JOINER = "\n\n"
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k")
_REQUEST_FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", *_SAMPLING_FIELDS,
                   "tools", "tool_choice", "thinking", "metadata", "cache_control", "service_tier",
                   "output_config", "context_management"}
# the fields each block type may carry; cache_control is accepted everywhere and changes nothing
_BLOCK_FIELDS = {"text": {"text", "citations"}, "tool_use": {"id", "name", "input"},
                 "tool_result": {"tool_use_id", "content", "is_error"}, "thinking": {"thinking", "signature"},
                 "redacted_thinking": {"data"}}
_TOOL_FIELDS = {"name", "description", "input_schema", "type", "cache_control", "eager_input_streaming", "strict"}
_TOOL_FIELDS_OFF = {"defer_loading": False, "input_examples": [], "allowed_callers": ["direct"]}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                529: "overloaded_error"}

StreamEvent = tuple[str, dict]  # (Anthropic event type, its data)


def serves(path: str) -> bool:
    """Whether `path` belongs to the Messages API (answered in Anthropic's error shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(status: int, message: str) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


# ---------------------------------------------------------------- the request

def parse_request(body: Any, sampling_defaults: dict | None = None,
                  require_max_tokens: bool = True) -> ChatCompletionRequest:
    """An Anthropic Messages request as the chat request the OpenAI route would build, or an APIError."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    for name in body:
        if name not in _REQUEST_FIELDS:
            raise _bad(f"{name}: unknown field (Sailfish refuses what it cannot honour)", name, "unknown_parameter")
    _check_no_effect_fields(body)
    _check_thinking(body.get("thinking"))
    _check_anthropic_ranges(body)
    max_tokens = _max_tokens({"max_tokens": body.get("max_tokens")})
    if max_tokens is None and require_max_tokens:
        raise APIError(400, "max_tokens: Field required", "max_tokens", "missing_required_parameter")
    if body.get("model") is None:  # required by Anthropic's API (any name is served: see server.app)
        raise APIError(400, "model: Field required", "model", "missing_required_parameter")
    system = _system_text(body.get("system"))
    messages = ([{"role": "system", "content": system}] if system else []) + _messages(body.get("messages"))
    raw_tools = _tools(body.get("tools"))
    tools, choice = _parse_tools_named(raw_tools), body.get("tool_choice")
    strict = strict_calls(tools)
    return ChatCompletionRequest(
        messages=parse_messages(messages), model=_opt(body, "model", str, "", "a string"), max_tokens=max_tokens,
        stop=_stop_sequences(body.get("stop_sequences")), stream=_opt(body, "stream", bool, False, "a boolean"),
        sampling=_sampling({k: body[k] for k in _SAMPLING_FIELDS if k in body}, sampling_defaults),
        tool_choice=parse_tool_choice(_tool_choice(choice, tools, strict), tools), tools=tools,
        strict_calls=strict, parallel_tool_calls=not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use")))


def _parse_tools_named(raw: list[dict] | None) -> list[dict]:
    """server.protocol.parse_tools, its errors naming the Messages API's fields:
    tools[0].function.parameters -> tools.0.input_schema, tools[0].function.strict -> tools.0.strict
    (and .name, .description)."""
    try:
        return parse_tools(raw)
    except APIError as e:
        def rename(text):
            text = re.sub(r"tools\[(\d+)\]", r"tools.\1", text)
            return text.replace(".function.parameters", ".input_schema").replace(".function.", ".")
        raise APIError(e.status, rename(e.message), rename(e.param) if e.param else None, e.code) from None


def _check_anthropic_ranges(body: dict) -> None:
    """Where Anthropic's ranges are narrower than the OpenAI route's checks (temperature 0-1, not
    0-2; top_k not negative, where -1 means "off" on the OpenAI route): refused as Anthropic refuses."""
    temperature, top_k = body.get("temperature"), body.get("top_k")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise _bad("temperature: must be between 0 and 1", "temperature")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k < 0:
        raise _bad("top_k: must be at least 0", "top_k")


def _check_no_effect_fields(body: dict) -> None:
    """The fields accepted without effect: their shape is checked, and a setting that would ask for
    something Sailfish does not do is refused."""
    for name in ("metadata", "cache_control", "output_config", "context_management"):
        _opt(body, name, dict, None, "an object")
    metadata = body.get("metadata") or {}
    extra = sorted(set(metadata) - {"user_id"})   # Anthropic's metadata holds user_id alone
    if extra:
        raise _bad(f"metadata.{extra[0]}: Extra inputs are not permitted", "metadata")
    if metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
        raise _bad("metadata.user_id: must be a string", "metadata")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise _bad("service_tier: must be 'auto' or 'standard_only'", "service_tier")
    output_config = body.get("output_config") or {}
    for name, value in output_config.items():
        if name == "format" and value is not None:
            raise _bad("output_config.format: structured outputs are not supported", "output_config",
                       "unsupported_value")
        if name not in ("effort", "format"):
            raise _bad(f"output_config.{name}: unknown field", "output_config", "unknown_parameter")
    edits = (body.get("context_management") or {}).get("edits") or []
    if not isinstance(edits, list) or not all(isinstance(e, dict) for e in edits):
        raise _bad("context_management.edits: must be an array of objects", "context_management", "invalid_type")
    for edit in edits:
        if not str(edit.get("type", "")).startswith("clear_thinking_"):
            raise _bad(f"context_management: edits of type {edit.get('type')!r} are not supported (Sailfish "
                       "edits no context; only clear_thinking edits, which have nothing to clear, are accepted)",
                       "context_management", "unsupported_value")


def _check_thinking(thinking: Any) -> None:
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("disabled", "adaptive"):
        return
    raise _bad(f"thinking: type {kind!r} is not supported: Sailfish cannot enforce a thinking budget. Send "
               "{\"type\": \"disabled\"} or {\"type\": \"adaptive\"} (in Claude Code: MAX_THINKING_TOKENS=0)",
               "thinking", "unsupported_value")


def _system_text(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    blocks = _blocks(system, "system")
    if any(block["type"] != "text" for block in blocks):
        raise _bad("system: only text blocks are allowed", "system")
    return _BLOCK_JOINER.join(block["text"] for block in blocks if not block["text"].startswith(BILLING_HEADER_PREFIX))


def _blocks(content: Any, where: str) -> list[dict]:
    """A message's content as validated blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or an array of content blocks", where, "invalid_type")
    for k, block in enumerate(content):
        at = f"{where}.{k}"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, (str, type(None))):
            raise _bad(f"{at}.type: must be a string", at, "invalid_type")
        if kind in ("image", "document"):
            raise _bad(f"{at}: {kind} blocks are not supported (Sailfish serves a text-only model)", at,
                       "unsupported_value")
        if kind not in _BLOCK_FIELDS:
            raise _bad(f"{at}: content blocks of type {kind!r} are not supported (text, tool_use, tool_result)", at,
                       "unsupported_value")
        for name in block:
            if name not in _BLOCK_FIELDS[kind] | {"type", "cache_control"}:
                raise _bad(f"{at}.{name}: unknown field of a {kind} block", at, "unknown_parameter")
        _check_block(block, at)
    return content


def _check_block(block: dict, at: str) -> None:
    kind = block["type"]
    if kind == "text" and not isinstance(block.get("text"), str):
        raise _bad(f"{at}.text: must be a string", at, "invalid_type")
    if kind == "tool_use":
        if not isinstance(block.get("id"), str) or not block["id"] or not isinstance(block.get("name"), str):
            raise _bad(f"{at}: a tool_use block needs a string id and name", at, "invalid_type")
        if not isinstance(block.get("input"), dict):
            raise _bad(f"{at}.input: must be an object", at, "invalid_type")
    if kind == "tool_result":
        if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
            raise _bad(f"{at}.tool_use_id: Field required", at, "missing_required_parameter")
        _opt(block, "is_error", bool, False, "a boolean")


def _messages(raw: Any) -> list[dict]:
    """Anthropic messages as OpenAI-shaped ones (server.protocol.parse_messages validates them further)."""
    if raw is None:
        raise APIError(400, "messages: Field required", "messages", "missing_required_parameter")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages: must be a non-empty array", "messages", "invalid_type")
    turns: list[tuple[str, list[dict], str]] = []  # (role, blocks, where), consecutive same roles merged
    for i, message in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _bad(f"{where}: must be an object", where, "invalid_type")
        extra = set(message) - {"role", "content"}
        if extra:
            raise _bad(f"{where}.{sorted(extra)[0]}: unknown field", where, "unknown_parameter")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"{where}.role: {role!r} is not one of 'user', 'assistant' (or 'system')", f"{where}.role")
        if "content" not in message:
            raise APIError(400, f"{where}.content: Field required", f"{where}.content", "missing_required_parameter")
        blocks = _blocks(message["content"], f"{where}.content")
        if turns and turns[-1][0] == role and role != "system":
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, list(blocks), where))
    if turns[-1][0] == "assistant":
        raise _bad(f"{turns[-1][2]}: a final assistant message (prefill) is not supported; end with a user "
                   "message", turns[-1][2], "unsupported_value")
    return [converted for role, blocks, where in turns for converted in _TURNS[role](blocks, where)]


def _user_turn(blocks: list[dict], where: str) -> list[dict]:
    """Tool results become tool messages; runs of text between them, user messages (in block order)."""
    out, texts = [], []
    for block in blocks:
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "tool_result":
            if texts:
                out.append({"role": "user", "content": _BLOCK_JOINER.join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _tool_result_text(block, where)})
        else:
            raise _bad(f"{where}: {block['type']} blocks belong to assistant messages", where, "invalid_value")
    if texts or not out:
        out.append({"role": "user", "content": _BLOCK_JOINER.join(texts)})
    return out


def _assistant_turn(blocks: list[dict], where: str) -> list[dict]:
    texts, calls, thoughts = [], [], []
    for block in blocks:
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _bad(f"{where}: a thinking block needs a string 'thinking'", where, "invalid_type")
            thoughts.append(block["thinking"])
        elif block["type"] == "tool_use":
            arguments = json.dumps(block["input"], ensure_ascii=False)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": arguments}})
        elif block["type"] == "tool_result":
            raise _bad(f"{where}: tool_result blocks belong to user messages", where, "invalid_value")
        # redacted_thinking: dropped (see the module docstring)
    message: dict = {"role": "assistant", "content": _BLOCK_JOINER.join(texts)}
    if calls:
        message["tool_calls"] = calls
    if any(thoughts):
        message["reasoning_content"] = _BLOCK_JOINER.join(thought for thought in thoughts if thought)
    return [message]


def _system_turn(blocks: list[dict], where: str) -> list[dict]:
    if any(block["type"] != "text" for block in blocks):
        raise _bad(f"{where}: a system message holds text blocks only", where, "invalid_value")
    return [{"role": "system", "content": _BLOCK_JOINER.join(block["text"] for block in blocks)}]


_TURNS: dict[str, Callable[[list[dict], str], list[dict]]] = {
    "user": _user_turn, "assistant": _assistant_turn, "system": _system_turn}


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = _blocks(content, f"{where}.tool_result.content")
        if any(part["type"] != "text" for part in parts):
            raise _bad(f"{where}: tool_result content holds text blocks only", where, "unsupported_value")
        text = _BLOCK_JOINER.join(part["text"] for part in parts)
    return json.dumps({"error": text}, ensure_ascii=False) if block.get("is_error") else text


def _tools(raw: Any) -> list[dict] | None:
    """Anthropic custom tools as OpenAI function tools (server.protocol.parse_tools validates them)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tools: must be an array", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(raw):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _bad(f"{where}: must be an object", where, "invalid_type")
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"{where}: server tools (type {tool['type']!r}) are not supported; send custom tools "
                       "(name, description, input_schema)", where, "unsupported_value")
        for name, value in tool.items():
            if name in _TOOL_FIELDS_OFF and value not in (None, _TOOL_FIELDS_OFF[name]):
                raise _bad(f"{where}.{name}: is not supported", where, "unsupported_value")
            if name not in _TOOL_FIELDS and name not in _TOOL_FIELDS_OFF:
                raise _bad(f"{where}.{name}: unknown field", where, "unknown_parameter")
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"{where}.input_schema: Field required (a JSON Schema object)", where,
                       "missing_required_parameter")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: Any, tools: list[dict], strict: bool = False) -> str | dict | None:
    """Anthropic's tool_choice as the OpenAI one (server.protocol.parse_tool_choice checks the name)."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice: must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    extra = set(raw) - {"type", "name", "disable_parallel_tool_use"}
    if extra:
        raise _bad(f"tool_choice.{sorted(extra)[0]}: unknown field", "tool_choice", "unknown_parameter")
    if _opt(raw, "disable_parallel_tool_use", bool, False, "a boolean") and kind == "auto" and not strict:
        raise _bad("tool_choice.disable_parallel_tool_use: enforced only with type 'any', 'tool' or strict tools "
                   "(with 'auto' the model may call several tools)", "tool_choice", "unsupported_value")
    if kind in ("any", "tool") and not tools:
        raise _bad(f"tool_choice: type {kind!r} needs at least one tool in 'tools'", "tool_choice")
    if kind == "tool":
        if not isinstance(raw.get("name"), str):
            raise _bad("tool_choice.name: Field required for type 'tool'", "tool_choice")
        return {"type": "function", "function": {"name": raw["name"]}}
    if kind == "auto" and not tools:
        return "none"
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def _stop_sequences(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise _bad("stop_sequences: must be an array of strings", "stop_sequences", "invalid_type")
    return tuple(s for s in raw if s)


# ---------------------------------------------------------------- the answer

def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _usage(usage: dict) -> dict:
    """Anthropic's usage from the OpenAI one: prompt tokens split into computed and reused."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0, "sailfish": usage["sailfish"]}


def _stop(finish: Finish, stop_sequences: tuple[str, ...]) -> dict:
    if finish.reason == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish.reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if finish.stop_string is not None and finish.stop_string in stop_sequences:
        return {"stop_reason": "stop_sequence", "stop_sequence": finish.stop_string}
    return {"stop_reason": "end_turn", "stop_sequence": None}


async def message_events(message_id: str, model: str, prompt_tokens: int, events: AsyncIterator,
                         stop_sequences: tuple[str, ...]) -> AsyncIterator[StreamEvent]:
    """A generation's events (server.serving.Event) as Anthropic's stream events. Consecutive reasoning
    deltas form one thinking block (signature ""), consecutive text deltas one text block; each tool
    call is one tool_use block, opened when its name is complete, one input_json_delta per arguments
    fragment, closed at its end (server.serving never puts reasoning inside a call). Text that is only
    whitespace is held back and dropped when thinking, a tool call or the end follows it."""
    yield "message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                  "cache_creation_input_tokens": 0}}}
    index, text_open, thinking_open, held = 0, False, False, ""
    try:
        async for event in events:
            if isinstance(event, (Reasoning, ToolCallStart)):  # ends the text block (never open with thinking)
                if text_open:
                    yield _block_stop(index)
                    index, text_open = index + 1, False
                held = ""
            if isinstance(event, Reasoning):
                if not thinking_open:
                    yield _block_start(index, {"type": "thinking", "thinking": "", "signature": ""})
                    thinking_open = True
                yield _block_delta(index, {"type": "thinking_delta", "thinking": event.text})
                continue
            if thinking_open:  # text, a tool call or the end: the thinking block is complete
                yield _block_stop(index)
                index, thinking_open = index + 1, False
            if isinstance(event, str):
                if text_open:
                    yield _block_delta(index, {"type": "text_delta", "text": event})
                    continue
                held += event
                if held.strip():
                    yield _block_start(index, {"type": "text", "text": ""})
                    yield _block_delta(index, {"type": "text_delta", "text": held})
                    text_open, held = True, ""
            elif isinstance(event, Finish):
                if text_open:
                    yield _block_stop(index)
                yield "message_delta", {"type": "message_delta", "delta": _stop(event, stop_sequences),
                                        "usage": _usage(event.usage)}
                yield "message_stop", {"type": "message_stop"}
            elif isinstance(event, ToolCallStart):
                yield _block_start(index, {"type": "tool_use", "id": _tool_use_id(event.id),
                                           "name": event.name, "input": {}})
            elif isinstance(event, ToolCallDelta):
                yield _block_delta(index, {"type": "input_json_delta", "partial_json": event.arguments})
            elif isinstance(event, ToolCallEnd):
                yield _block_stop(index)
                index += 1
    finally:
        await events.aclose()  # closed early (a client went away): stop the generation now


def _block_start(index: int, block: dict) -> StreamEvent:
    return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}


def _block_delta(index: int, delta: dict) -> StreamEvent:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _block_stop(index: int) -> StreamEvent:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


async def whole_message(stream: AsyncIterator[StreamEvent]) -> dict:
    """The `message` object that a stream of events describes (as an Anthropic client accumulates it)."""
    message: dict = {}
    partial_json: dict[int, str] = {}
    async for kind, data in stream:
        if kind == "message_start":
            message = data["message"]
        elif kind == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            delta, index = data["delta"], data["index"]
            if delta["type"] == "text_delta":
                message["content"][index]["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                message["content"][index]["thinking"] += delta["thinking"]
            else:
                partial_json[index] = partial_json.get(index, "") + delta["partial_json"]
        elif kind == "content_block_stop" and message["content"][data["index"]]["type"] == "tool_use":
            message["content"][data["index"]]["input"] = partial_json_object(partial_json.pop(data["index"], ""))
        elif kind == "message_delta":
            message.update(data["delta"])
            message["usage"] = data["usage"]
    return message


def partial_json_object(text: str) -> dict:
    """The object a tool_use block's streamed JSON describes: the JSON itself when it is whole, else
    what Anthropic's SDK reads from a partial one (jiter's partial mode): an unfinished string is
    dropped together with its key (or array slot), and the open objects and arrays are closed. The
    fragments Sailfish streams never end in a dangling key, separator or number
    (common.chat_format._ArgumentsConverter), so that is the whole repair; "" is {}."""
    try:
        value = json.loads(text) if text else {}
        return value if isinstance(value, dict) else {"value": value}
    except ValueError:
        pass
    open_brackets: list[list] = []  # [closer, where its current element starts]
    in_string = escaped = False
    for at, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            open_brackets.append(["}" if char == "{" else "]", at + 1])
        elif char in "}]" and open_brackets:
            open_brackets.pop()
        elif char == "," and open_brackets:
            open_brackets[-1][1] = at
    if in_string and open_brackets:
        text = text[:open_brackets[-1][1]]
    repaired = text + "".join(closer for closer, _ in reversed(open_brackets))
    try:
        value = json.loads(repaired)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def _sse_event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse(stream: AsyncIterator[StreamEvent], service: Service) -> AsyncIterator[str]:
    """The stream as SSE; an error after the stream began is its last event, in the error shape
    (a generic message for an unexpected one, which is logged)."""
    try:
        async for kind, data in stream:
            yield _sse_event(kind, data)
    except APIError as e:
        yield _sse_event("error", error_body(e.status, e.message))
    except Exception:
        log.exception("messages stream failed")
        service.metrics.internal_error()
        yield _sse_event("error", error_body(500, "internal error while generating"))
    finally:
        await stream.aclose()


# ---------------------------------------------------------------- the routes

def routes(service: Service, read_json: Callable[[Request], Awaitable[Any]], guarded: Callable) -> list[Route]:
    """POST /v1/messages and /v1/messages/count_tokens; `read_json` reads a request's body (app.py's
    size-limited reader), `guarded` answers a handler's errors (app.py's), here in Anthropic's shape."""
    async def messages(request: Request) -> Response:
        req = parse_request(await read_json(request), service.sampling_defaults)
        prep, events = await service.chat_events(req, request.receive, endpoint="messages")
        stream = message_events(new_message_id(), service.model_id, len(prep.prompt_ids), events, req.stop)
        if req.stream:
            return StreamingResponse(_sse(stream, service), media_type="text/event-stream", headers=_SSE_HEADERS)
        return JSONResponse(await whole_message(stream))

    async def count_tokens(request: Request) -> Response:
        req = parse_request(await read_json(request), service.sampling_defaults, require_max_tokens=False)
        return JSONResponse({"input_tokens": await asyncio.to_thread(service.count_chat_tokens, req)})

    guard = functools.partial(guarded, answer=lambda e: error_response(e.status, e.message), logger=log)
    return [Route(MESSAGES_PATH, guard(messages), methods=["POST"]),
            Route(MESSAGES_PATH + "/count_tokens", guard(count_tokens), methods=["POST"])]
