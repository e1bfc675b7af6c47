"""The OpenAI Responses API (`POST /v1/responses`), stateless, as a translation over the chat path.

Contract: `ResponsesRequest.parse(body, sampling_defaults)` validates a Responses request and
translates it into the internal `ChatCompletionRequest` (`.chat`), keeping the request fields a
Response object restates (`.echoed`); bad input is an `APIError` 400 naming the Responses parameter
(`input[2].call_id`, `tools[0].name`, ...). `create_response(service, req, receive)` generates through
`Service.chat_events`, the one generation path chat completions use, and returns a Response object
(a dict) or, when `req.chat.stream`, an async iterator of SSE lines (`event: TYPE` + `data: {...}`,
every data carrying `type` and `sequence_number`). Both come from one fold of the generation's events
(`_response_events`), so a streamed answer and a whole one are the same; the whole one is the stream's
final response.

Translation. `instructions` becomes a leading system message; `input` is a string (one user message)
or a list of items: messages (role user/system/developer/assistant, content a string or
`input_text`/`output_text` parts), `function_call` items (assistant tool calls; consecutive ones and
the assistant message before them form one assistant turn) and `function_call_output` items (tool
messages). Tools are the flat `{"type": "function", "name", "description", "parameters", "strict"}`.
Output: one `reasoning` item per run of the model's thinking (Gemma 4's thinking channel; `summary: []`,
one `reasoning_text` content part, streamed as `response.reasoning_text.delta`), one `message` item per
run of text (`output_text` parts) and one `function_call` item per call, added when its name is
complete, its arguments streamed as `response.function_call_arguments.delta` fragments as they are
generated; finish_reason "length" is `status: "incomplete"` with `incomplete_details.reason:
"max_output_tokens"`, and a call it cut off is a `function_call` item with `status: "incomplete"` whose
arguments are the unfinished JSON streamed so far. A `reasoning` input item with `reasoning_text`
content (what Sailfish answers) becomes the `reasoning_content` of the assistant turn that follows it,
rendered back as the chat format decides (only in a tool loop still in progress); one without content
(another server's encrypted or summary-only item) is refused.

Field policy (as server.protocol: a field that cannot be honoured is refused, never ignored):
- Stateless: nothing is stored, so `previous_response_id`, `conversation`, `prompt` (a stored
  template), `background: true` and `store: true` are 400s. `store` absent or false is accepted and
  the Response says `store: false`, so clients that omit `store` (the openai client and the Agents
  SDK by default) keep working, while one that asks for storage is told it gets none.
- Refused unless off: `reasoning` (Sailfish runs no reasoning effort; null or all-null is accepted),
  `text.format` other than text, `text.verbosity`, `truncation: "auto"` (a prompt past the context is a
  400, which is "disabled"), `include: ["message.output_text.logprobs"]`, `max_tool_calls`,
  `context_management`, `prompt_cache_retention`/`prompt_cache_options`, non-function tools, input
  items other than the three above (and reasoning), and non-text content parts.
- Accepted with no effect: `user`, `safety_identifier`, `prompt_cache_key` (the prefix cache needs no
  key), `metadata` (echoed), `service_tier`, `stream_options` (`include_obfuscation: false`, with
  `stream`), and the `include` values that ask for
  parts of items Sailfish never produces (encrypted reasoning, search, computer, code interpreter,
  images).
- `strict` on a function tool is honoured as on chat completions (server.serving: its calls follow
  the schema under tool_choice "auto" too; a schema using what the grammar cannot enforce is refused)
  and echoed.
- `temperature` / `top_p` are range-checked as on chat (server.protocol._sampling); the Response
  states the values used, the checkpoint's defaults included.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from server.protocol import (_TOOL_NAME, APIError, ChatCompletionRequest, _bad, _opt, _refuse_unknown, _sampling,
                             _stream, check_one_call, check_tool_results, error_body, json_arguments,
                             parse_tool_choice, parse_tools, strict_calls)
from server.serving import Finish, Reasoning, Service, ToolCallDelta, ToolCallEnd, ToolCallStart

log = logging.getLogger("sailfish.responses")

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text")

# Refused when set to anything but their "off" value: what each would need that Sailfish lacks.
_REFUSED_UNLESS_OFF = {
    "previous_response_id": "previous_response_id needs stored responses; Sailfish is stateless: send the "
                            "whole conversation in 'input'",
    "conversation": "conversations need stored state; Sailfish is stateless: send the whole conversation in 'input'",
    "prompt": "stored prompt templates are not supported; send 'instructions' and 'input'",
    "background": "background responses need stored state; Sailfish is stateless",
    "max_tool_calls": "max_tool_calls is not supported",
    "context_management": "context_management is not supported",
    "prompt_cache_retention": "prompt_cache_retention is not supported (the prefix cache is in memory, "
                              "least recently used first out)",
    "prompt_cache_options": "prompt_cache_options are not supported",
}
_KNOWN_FIELDS = {"input", "model", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                 "max_output_tokens", "temperature", "top_p", "stream", "text", "include", "truncation",
                 "reasoning", "safety_identifier", "prompt_cache_key", *_REFUSED_UNLESS_OFF}
# include values about items Sailfish never produces or accepts: there is nothing to include
_VACUOUS_INCLUDES = {"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content"}
# keys of input items and parts that describe them (ids, statuses, annotations) and ask for nothing
_DESCRIPTIVE_KEYS = {"id", "status", "annotations", "logprobs", "phase"}
_OFF_VALUES = (None, False, 0, {}, [], "")


@dataclass
class ResponsesRequest:
    chat: ChatCompletionRequest   # the translation the chat path generates from
    echoed: dict                  # the Response object's fields that restate the request

    @classmethod
    def parse(cls, body: Any, sampling_defaults: dict | None = None) -> "ResponsesRequest":
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_type")
        _refuse_unhonourable(body)
        _refuse_unknown(body, _KNOWN_FIELDS)
        instructions = _opt(body, "instructions", str, None, "a string")
        messages = parse_input(body.get("input"), instructions)
        check_tool_results(messages, param="input")
        tools = parse_function_tools(body.get("tools"))
        strict = strict_calls(tools)
        tool_choice = parse_tool_choice(_chat_tool_choice(body.get("tool_choice")), tools)
        parallel = _opt(body, "parallel_tool_calls", bool, True, "a boolean")
        check_one_call(parallel, tool_choice, strict)
        max_output_tokens = _opt(body, "max_output_tokens", int, None, "an integer")
        if max_output_tokens is not None and max_output_tokens < 1:
            raise _bad(f"'max_output_tokens' must be at least 1, got {max_output_tokens}", "max_output_tokens")
        sampling = _sampling(body, sampling_defaults)
        stream, _ = _stream(body, usage=False)
        user = _opt(body, "user", str, None, "a string")
        metadata = _opt(body, "metadata", dict, {}, "an object")
        for name in ("safety_identifier", "prompt_cache_key"):
            _opt(body, name, str, None, "a string")
        chat = ChatCompletionRequest(messages=messages, model=_opt(body, "model", str, "", "a string"),
                                     max_tokens=max_output_tokens, stream=stream, sampling=sampling,
                                     tool_choice=tool_choice, tools=tools, user=user,
                                     parallel_tool_calls=parallel, strict_calls=strict)
        echoed = {"instructions": instructions, "metadata": metadata, "parallel_tool_calls": parallel,
                  "temperature": sampling.temperature, "top_p": sampling.top_p,
                  # as OpenAI echoes it: "auto" when the request names none (with no tools it calls none)
                  "tool_choice": _responses_tool_choice(tool_choice) if body.get("tool_choice") is not None else "auto",
                  "tools": _echoed_tools(tools, body),
                  "max_output_tokens": max_output_tokens, "user": user}
        return cls(chat, echoed)


# ---------------------------------------------------------------- request fields

def _refuse_unhonourable(body: dict) -> None:
    """The Responses fields that cannot be honoured unless off (see the module's field policy)."""
    for name, reason in _REFUSED_UNLESS_OFF.items():
        if body.get(name) not in _OFF_VALUES:
            raise _bad(reason, name, "unsupported_value")
    if body.get("store") not in (None, False):
        raise _bad("store=true cannot be honoured: Sailfish is stateless and keeps no responses; "
                   "send store=false or omit it", "store", "unsupported_value")
    reasoning = _opt(body, "reasoning", dict, {}, "an object")
    if any(value is not None for value in reasoning.values()):
        raise _bad("reasoning options are not supported (the model runs without a reasoning effort)",
                   "reasoning", "unsupported_value")
    text = _opt(body, "text", dict, {}, "an object")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") != "text":
        raise _bad("text.format must be {\"type\": \"text\"} (structured output is not supported)",
                   "text.format", "unsupported_value")
    for key, value in text.items():
        if key != "format" and value is not None:
            raise _bad(f"text.{key} is not supported", f"text.{key}", "unsupported_value")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation must be 'disabled' (a prompt longer than the context is refused, never cut)",
                   "truncation", "unsupported_value")
    include = _opt(body, "include", list, [], "an array")
    for k, value in enumerate(include):
        if not isinstance(value, str) or value not in _VACUOUS_INCLUDES:
            raise _bad(f"include[{k}] {value!r} is not supported", "include", "unsupported_value")


def parse_input(raw: Any, instructions: str | None) -> list[dict]:
    """`instructions` and `input` as the normalized chat messages of server.protocol.parse_messages."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if raw is None:
        raise APIError(400, "Missing required parameter: 'input'.", "input", "missing_required_parameter")
    if isinstance(raw, str):
        return messages + [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise _bad("'input' must be a string or an array of input items", "input", "invalid_type")
    if not raw:
        raise _bad("'input' must contain at least one item", "input", "empty_array")
    call_names: dict[str, str] = {}
    reasoning: list[str] = []  # reasoning items awaiting the assistant turn they precede
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
            continue
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            call_names[call["id"]] = call["function"]["name"]
            _add_tool_call(messages, call)
        elif kind == "function_call_output":
            messages.append(_function_call_output(item, where, call_names))
        elif kind == "item_reference":
            raise _bad(f"{where}: item references need stored items; Sailfish is stateless: send the item itself",
                       f"{where}.type", "unsupported_value")
        else:
            raise _bad(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output and reasoning only)", f"{where}.type", "unsupported_value")
        if messages[-1]["role"] == "assistant" and reasoning:
            earlier = messages[-1].get("reasoning_content")
            messages[-1]["reasoning_content"] = "\n\n".join(t for t in [earlier, *reasoning] if t)
            reasoning = []
        elif messages[-1]["role"] != "assistant":
            reasoning = []  # thinking with no assistant turn after it renders nowhere
    return messages


def _reasoning_text(item: dict, where: str) -> str:
    """The text of a reasoning item's `reasoning_text` parts; an item without them is refused (it is
    not one Sailfish answered: its thinking is encrypted or summarized, which cannot be rendered)."""
    _refuse_extra_keys(item, {"type", "summary", "content"}, where)
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise _bad(f"{where}: reasoning items need their reasoning_text content (Sailfish renders its own "
                   "model's thinking back; encrypted or summary-only reasoning cannot be)", f"{where}.type",
                   "unsupported_value")
    texts = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise _bad(f"{at} must be {{\"type\": \"reasoning_text\", \"text\": ...}}", at, "invalid_type")
        _refuse_extra_keys(part, {"type", "text"}, at)
        texts.append(part["text"])
    return "".join(texts)


def _refuse_extra_keys(obj: dict, allowed: set[str], where: str) -> None:
    """A key an item does not define is refused unless null (a client's dump of unset optional fields)."""
    for key, value in obj.items():
        if key not in allowed and key not in _DESCRIPTIVE_KEYS and value is not None:
            raise _bad(f"{where}.{key} is not supported", f"{where}.{key}", "unsupported_value")


def _message(item: dict, where: str) -> dict:
    _refuse_extra_keys(item, {"type", "role", "content"}, where)
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise _bad(f"{where}.role {role!r} is not one of {', '.join(MESSAGE_ROLES)}", f"{where}.role")
    return {"role": "system" if role == "developer" else role, "content": _text(item.get("content"), where, "content")}


def _text(content: Any, where: str, key: str) -> str:
    """A string, or the text of a list of input_text/output_text parts (other parts are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.{key} must be a string or an array of text parts", f"{where}.{key}", "invalid_type")
    texts = []
    for k, part in enumerate(content):
        at = f"{where}.{key}[{k}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{at} is not a content part", at, "invalid_type")
        if part["type"] not in TEXT_PART_TYPES:
            raise _bad(f"{at}: content parts of type {part['type']!r} are not supported (text only)", at,
                       "unsupported_value")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{at}.text must be a string", f"{at}.text", "invalid_type")
        _refuse_extra_keys(part, {"type", "text"}, at)
        texts.append(part["text"])
    return "".join(texts)


def _function_call(item: dict, where: str) -> dict:
    """A function_call item as an OpenAI chat tool call whose id is the item's call_id."""
    _refuse_extra_keys(item, {"type", "call_id", "name", "arguments"}, where)
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise APIError(400, f"{where}: a function_call needs 'call_id'", f"{where}.call_id", "missing_required_parameter")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise _bad(f"{where}.name must be 1-128 letters, digits, _ . : or -", f"{where}.name")
    arguments = json_arguments(item.get("arguments"), f"{where}.arguments", f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_tool_call(messages: list[dict], call: dict) -> None:
    """Consecutive calls, and the assistant text right before them, are one assistant turn."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _function_call_output(item: dict, where: str, call_names: dict[str, str]) -> dict:
    _refuse_extra_keys(item, {"type", "call_id", "output"}, where)
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise APIError(400, f"{where}: a function_call_output needs 'call_id'", f"{where}.call_id",
                       "missing_required_parameter")
    if "output" not in item:
        raise APIError(400, f"{where}: a function_call_output needs 'output'", f"{where}.output",
                       "missing_required_parameter")
    message = {"role": "tool", "tool_call_id": call_id, "content": _text(item["output"], where, "output")}
    if call_id in call_names:
        message["name"] = call_names[call_id]
    return message


def parse_function_tools(raw: Any) -> list[dict]:
    """Flat Responses function tools as chat's nested tools (validated by server.protocol.parse_tools)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("'tools' must be an array", "tools", "invalid_type")
    nested = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        if tool.get("type") != "function":
            raise _bad(f"{where}: tools of type {tool.get('type')!r} are not supported (function tools only)",
                       f"{where}.type", "unsupported_value")
        _refuse_extra_keys(tool, {"type", "name", "description", "parameters", "strict"}, where)
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        nested.append({"type": "function", "function": function})
    try:
        return parse_tools(nested)
    except APIError as e:  # name the flat shape's parameter: tools[0].function.name -> tools[0].name
        raise APIError(e.status, e.message.replace(".function.", "."),
                       e.param.replace(".function.", ".") if e.param else None, e.code) from None


def _chat_tool_choice(raw: Any) -> Any:
    """The Responses tool_choice in chat's shape, for server.protocol.parse_tool_choice."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise _bad("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
               "tool_choice")


def _responses_tool_choice(choice: str | dict) -> str | dict:
    return {"type": "function", "name": choice["name"]} if isinstance(choice, dict) else choice


def _echoed_tools(tools: list[dict], body: dict) -> list[dict]:
    strict = [t.get("strict") for t in body.get("tools") or []]
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
             "parameters": t["function"]["parameters"], "strict": s} for t, s in zip(tools, strict)]


# ---------------------------------------------------------------- the response

async def create_response(service: Service, req: ResponsesRequest, receive=None) -> dict | AsyncIterator[str]:
    """A Response object, or its SSE event stream when `req.chat.stream`."""
    try:
        _, events = await service.chat_events(req.chat, receive, endpoint="responses")
    except APIError as e:
        raise _in_responses_terms(e) from None
    stream = _response_events(service.model_id, req, events)
    if req.chat.stream:
        return _sse(service, stream)
    final = None
    async for event in stream:
        final = event
    return final["response"]


def _in_responses_terms(error: APIError) -> APIError:
    """A chat-path refusal naming the Responses parameter (messages -> input, max_tokens -> max_output_tokens)."""
    renamed = {"messages": "input", "max_tokens": "max_output_tokens"}.get(error.param or "")
    if renamed is None:
        return error
    return APIError(error.status, error.message.replace(error.param, renamed), renamed, error.code, error.type)


class _ResponseBuilder:
    """The Response object and its stream events, built from one generation's events in order."""

    def __init__(self, model: str, req: ResponsesRequest):
        self.id, self.created_at = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.model, self.req = model, req
        self.output: list[dict] = []
        self.sequence_number = 0
        self.message: dict | None = None   # the message item being streamed, if any
        self.call: dict | None = None      # the function_call item being streamed, if any
        self.reasoning_item: dict | None = None  # the reasoning item being streamed, if any
        self.pending = ""                  # leading whitespace not yet worth a message item

    def event(self, type: str, **fields) -> dict:
        event = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def response(self, status: str, usage: dict | None = None, incomplete_reason: str | None = None) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
                "model": self.model, "output": list(self.output), "previous_response_id": None,
                "reasoning": None, "store": False, "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "usage": usage, **self.req.echoed}
        if status == "completed":
            body["completed_at"] = int(time.time())
        return body

    def started(self) -> list[dict]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def reasoning(self, delta: str) -> list[dict]:
        """A delta of the model's thinking: into the open reasoning item, else a new one (closing an
        open message item; whitespace held before it is dropped)."""
        events = []
        if self.reasoning_item is None:
            events, self.pending = self.close_message(), ""
            self.reasoning_item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                                   "content": [], "status": "in_progress"}
            self.output.append(self.reasoning_item)
            index, part = len(self.output) - 1, {"type": "reasoning_text", "text": ""}
            events += [self.event("response.output_item.added", output_index=index, item=_copy(self.reasoning_item)),
                       self.event("response.content_part.added", item_id=self.reasoning_item["id"],
                                  output_index=index, content_index=0, part=_copy(part))]
            self.reasoning_item["content"].append(part)
        self.reasoning_item["content"][0]["text"] += delta
        return events + [self.event("response.reasoning_text.delta", item_id=self.reasoning_item["id"],
                                    output_index=len(self.output) - 1, content_index=0, delta=delta)]

    def close_reasoning(self, status: str = "completed") -> list[dict]:
        item, self.reasoning_item = self.reasoning_item, None
        return self._close_text_item(item, status, "response.reasoning_text.done") if item is not None else []

    def text(self, delta: str) -> list[dict]:
        """A text delta; a message item opens at its first text that is not whitespace only (closing
        an open reasoning item)."""
        if self.message is None:
            self.pending += delta
            if not self.pending.strip():
                return []
            delta, self.pending = self.pending, ""
            events = self.close_reasoning() + self._open_message()
        else:
            events = []
        return events + [self._append(delta)]

    def _append(self, delta: str) -> dict:
        self.message["content"][0]["text"] += delta
        return self.event("response.output_text.delta", item_id=self.message["id"],
                          output_index=len(self.output) - 1, content_index=0, delta=delta, logprobs=[])

    def _open_message(self) -> list[dict]:
        self.message = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                        "role": "assistant", "content": []}
        self.output.append(self.message)
        index, part = len(self.output) - 1, {"type": "output_text", "text": "", "annotations": []}
        events = [self.event("response.output_item.added", output_index=index, item=_copy(self.message)),
                  self.event("response.content_part.added", item_id=self.message["id"], output_index=index,
                             content_index=0, part=_copy(part))]
        self.message["content"].append(part)
        return events

    def close_message(self, status: str = "completed") -> list[dict]:
        message, self.message = self.message, None
        return self._close_text_item(message, status, "response.output_text.done", logprobs=[]) \
            if message is not None else []

    def _close_text_item(self, item: dict, status: str, done_event: str, **done_fields) -> list[dict]:
        """The done events of the last output item (a message or reasoning item with one text part)."""
        index, part = len(self.output) - 1, item["content"][0]
        item["status"] = status
        return [self.event(done_event, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                           **done_fields),
                self.event("response.content_part.done", item_id=item["id"], output_index=index,
                           content_index=0, part=_copy(part)),
                self.event("response.output_item.done", output_index=index, item=_copy(item))]

    def function_call_start(self, start: ToolCallStart) -> list[dict]:
        """A tool call whose name is complete opens a function_call item; whitespace before it is dropped."""
        events, self.pending = self.close_reasoning() + self.close_message(), ""
        self.call = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": start.id,
                     "name": start.name, "arguments": "", "status": "in_progress"}
        self.output.append(self.call)
        return events + [self.event("response.output_item.added", output_index=len(self.output) - 1,
                                    item=_copy(self.call))]

    def function_call_arguments(self, delta: ToolCallDelta) -> list[dict]:
        self.call["arguments"] += delta.arguments
        return [self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                           output_index=len(self.output) - 1, delta=delta.arguments)]

    def function_call_end(self, end: ToolCallEnd) -> list[dict]:
        """The open function_call item is done: "completed", or "incomplete" for a call cut off."""
        item, index, self.call = self.call, len(self.output) - 1, None
        item.update(arguments=end.call["function"]["arguments"], status="completed" if end.complete else "incomplete")
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=_copy(item))]

    def finished(self, finish: Finish) -> list[dict]:
        incomplete = finish.reason == "length"
        events = self.close_reasoning("incomplete" if incomplete else "completed")
        if not self.output:  # an answer with no text still has a message item
            events += self._open_message()
            if self.pending:
                events.append(self._append(self.pending))
        events += self.close_message("incomplete" if incomplete else "completed")
        usage = responses_usage(finish.usage)
        if incomplete:
            return events + [self.event("response.incomplete",
                                        response=self.response("incomplete", usage, "max_output_tokens"))]
        return events + [self.event("response.completed", response=self.response("completed", usage))]


async def _response_events(model: str, req: ResponsesRequest, events) -> AsyncIterator[dict]:
    """The stream events of one Response, the last carrying the whole Response."""
    builder = _ResponseBuilder(model, req)
    try:
        for event in builder.started():
            yield event
        async for item in events:
            if isinstance(item, str):
                produced = builder.text(item)
            elif isinstance(item, Reasoning):
                produced = builder.reasoning(item.text)
            elif isinstance(item, ToolCallStart):
                produced = builder.function_call_start(item)
            elif isinstance(item, ToolCallDelta):
                produced = builder.function_call_arguments(item)
            elif isinstance(item, ToolCallEnd):
                produced = builder.function_call_end(item)
            else:  # the Finish
                produced = builder.finished(item)
            for event in produced:
                yield event
    finally:
        await events.aclose()


def responses_usage(chat_usage: dict) -> dict:
    """Chat usage in the Responses shape; Sailfish's own figures stay under `sailfish`. A local server
    charges no cache writes (cache_write_tokens 0), and thinking is not counted apart (reasoning_tokens 0:
    its tokens are in output_tokens)."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"], "sailfish": chat_usage.get("sailfish", {})}


async def _sse(service: Service, events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Events as SSE. Once streaming has begun the status is sent, so an error is one last `error` event
    (the Responses shape: type, code, message, param; a generic message for unexpected ones)."""
    sequence_number = 0
    try:
        async for event in events:
            sequence_number = event["sequence_number"] + 1
            yield _sse_event(event)
    except APIError as e:
        yield _sse_event(_error_event(e.body(), sequence_number))
    except Exception:
        log.exception("responses stream failed")
        service.metrics.internal_error()
        body = error_body("internal error while generating", "server_error", None, "internal_error")
        yield _sse_event(_error_event(body, sequence_number))
    finally:
        await events.aclose()  # a client that went away closes us: cancel the generation now


def _error_event(body: dict, sequence_number: int) -> dict:
    error = body["error"]
    return {"type": "error", "sequence_number": sequence_number, "code": error["code"],
            "message": error["message"], "param": error["param"]}


def _sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def _copy(item: dict) -> dict:
    """A snapshot of an item as it is now (the builder keeps changing its own)."""
    return json.loads(json.dumps(item))
