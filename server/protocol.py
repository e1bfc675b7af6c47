"""OpenAI request and response types, and the validation that turns bad input into a 4xx.

Contract: `ChatCompletionRequest.parse(body)` / `CompletionRequest.parse(body)` take the decoded
JSON body and return a validated request or raise `APIError` (status, message, type, param, code),
whose `body()` is the one error shape every endpoint uses:
`{"error": {"message", "type", "param", "code"}}`. Fields are listed in the order of the OpenAI
API reference. Fields with no effect on what Sailfish does (`store`, `metadata`, `user`,
`service_tier`) are accepted, their shapes checked (`store: true` and a service tier other than
`auto` / `default` ask for what is not done: refused); every sampling field is honoured (server.sampling); `response_format`
json_object / json_schema, a required or named `tool_choice` and `strict` tools (under "auto" too)
are enforced by a grammar (server.grammar; `parallel_tool_calls: false` too, where a call is enforced); fields whose meaning
Sailfish cannot honour (`n` > 1, `logprobs: true`, `logit_bias`, image or audio content, an unknown
field) are refused with a 400 rather than silently ignored. The response builders at the end
return plain dicts shaped like OpenAI's responses and stream chunks.
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.chat_format import MAX_VALUE_DEPTH, json_depth
from common.json_text import lone_surrogate_at, may_hold_lone_surrogate
from server.sampling import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_BODY_BYTES = 32 * 2**20   # a request body past this gets a 413 (an 80k-token conversation is ~0.4 MB)
MAX_JSON_DEPTH = MAX_VALUE_DEPTH  # nesting of the body, and of any JSON string inside it (tool arguments)
SEED_RANGE = (-2**63, 2**64 - 1)
SAMPLING_EPS = 1e-5           # a temperature below this is greedy decoding (as vLLM), not a division by ~0
# Tool names end up inside `call:NAME{` in the Gemma 4 format: no whitespace, braces or angle brackets.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}  # sent with the error response (a 429's Retry-After)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(message: str, param: str | None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def parse_body(raw: bytes) -> Any:
    """The decoded JSON of a request body, or an APIError: 413 past MAX_BODY_BYTES, 400 for invalid
    JSON, nesting deeper than MAX_JSON_DEPTH, or a string holding a lone surrogate (not text)."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body has {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", None,
                       "request_too_large")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _bad(f"the request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)", None,
                   "too_deep") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from e
    if json_depth(body) > MAX_JSON_DEPTH:
        raise _bad(f"the request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)", None, "too_deep")
    # json.loads also takes UTF-16 and UTF-32 bodies (a NUL in their first bytes), whose escapes the
    # byte scan cannot see: those are walked whole
    if may_hold_lone_surrogate(raw) or b"\x00" in raw[:4]:
        where = lone_surrogate_at(body)
        if where is not None:
            raise _bad(f"'{where}' holds a lone UTF-16 surrogate (an escape from \\ud800 to \\udfff that is not "
                       "half of a pair): it is not text", where)
    return body


def _finite(name: str, value: Any) -> float:
    try:
        x = float(value)
    except OverflowError:
        raise _bad(f"'{name}' is out of range", name) from None
    if not math.isfinite(x):
        raise _bad(f"'{name}' must be a finite number", name)
    return x


# ---------------------------------------------------------------- field readers

def _opt(body: dict, name: str, kind: type | tuple, default: Any = None, what: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass: never accept true for an integer field
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise _bad(f"'{name}' must be {what or kind.__name__}, got a boolean", name, "invalid_type")
    if not isinstance(value, kind):
        raise _bad(f"'{name}' must be {what or getattr(kind, '__name__', 'valid')}, got {type(value).__name__}",
                   name, "invalid_type")
    return value


def _max_tokens(body: dict) -> int | None:
    """The completion limit: `max_completion_tokens` (OpenAI's current name) or `max_tokens` (its older
    one, vLLM's), each an integer of at least 1; both may be sent if they agree, and two different
    values get a 400 naming max_completion_tokens. (`_max_tokens_field` names the one sent.)"""
    values = {}
    for name in ("max_completion_tokens", "max_tokens"):
        value = _opt(body, name, int, what="an integer")
        if value is not None:
            if value < 1:
                raise _bad(f"'{name}' must be at least 1, got {value}", name)
            values[name] = value
    if len(set(values.values())) > 1:
        raise _bad(f"'max_completion_tokens' ({values['max_completion_tokens']}) and 'max_tokens' "
                   f"({values['max_tokens']}) disagree: send one of them, or the same value",
                   "max_completion_tokens")
    return next(iter(values.values()), None)


def _max_tokens_field(body: dict) -> str:
    """The name the completion limit came under, for errors about its value."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")


# (field, lowest, highest, whether the lowest is allowed): OpenAI's ranges, vLLM's for its extras
_SAMPLING_RANGES = {"temperature": (0.0, 2.0, True), "top_p": (0.0, 1.0, False), "min_p": (0.0, 1.0, True),
                    "presence_penalty": (-2.0, 2.0, True), "frequency_penalty": (-2.0, 2.0, True),
                    "repetition_penalty": (0.0, 10.0, False)}


def _sampling(body: dict, defaults: dict | None = None) -> SamplingParams:
    """The request's sampling fields, range-checked; a field the request omits takes its value from
    `defaults` (the checkpoint's generation_config, see server.generation_defaults), else greedy."""
    defaults = defaults or {}
    values: dict[str, Any] = {}
    for name, (low, high, low_ok) in _SAMPLING_RANGES.items():
        default = defaults.get(name, getattr(SamplingParams, name))
        value = _finite(name, _opt(body, name, (int, float), default, "a number"))
        if not (low <= value <= high) or (value == low and not low_ok):
            raise _bad(f"'{name}' must be {'at least' if low_ok else 'above'} {low:g} and at most {high:g}, "
                       f"got {value}", name)
        values[name] = float(value)
    if values["temperature"] < SAMPLING_EPS:
        values["temperature"] = 0.0
    top_k = _opt(body, "top_k", int, defaults.get("top_k", 0), "an integer")
    if top_k < -1:
        raise _bad(f"'top_k' must be -1 or 0 (off) or a positive integer, got {top_k}", "top_k")
    n = _opt(body, "n", int, 1, "an integer")
    if n != 1:
        raise _bad("only n=1 is supported", "n", "unsupported_value")
    seed = _opt(body, "seed", int, None, "an integer")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise _bad("'seed' must fit in 64 bits", "seed")
    return SamplingParams(top_k=max(top_k, 0), seed=seed, **values)


# Fields a client may send that change nothing Sailfish does; any other field it does not know is refused.
_NO_EFFECT_FIELDS = {"user", "metadata", "store", "service_tier", "stream_options"}
_UNSUPPORTED = {"logit_bias": "logit_bias is not supported", "top_logprobs": "top_logprobs are not supported",
                "min_tokens": "min_tokens is not supported", "ignore_eos": "ignore_eos is not supported",
                "prediction": "predicted outputs are not supported", "audio": "audio output is not supported",
                "modalities": "only text output is supported", "functions": "the legacy 'functions' field is "
                "not supported; send 'tools'", "function_call": "the legacy 'function_call' field is not "
                "supported; send 'tool_choice'", "suffix": "suffix (insertion) is not supported"}


def _refuse_unknown(body: dict, known: set[str]) -> None:
    """A field that cannot be honoured is refused with a 400, never silently ignored."""
    for name, value in body.items():
        if name in known or name in _NO_EFFECT_FIELDS:
            continue
        if name in _UNSUPPORTED:
            if value in (None, False, 0, {}, [], ""):  # the field's "off" value asks for nothing
                continue
            if name == "modalities" and value == ["text"]:  # text output: what is served
                continue
            raise _bad(_UNSUPPORTED[name], name, "unsupported_value")
        raise _bad(f"unknown parameter {name!r}", name, "unknown_parameter")
    _check_no_effect_fields(body)


_SERVICE_TIERS = ("auto", "default")  # one tier here; "flex", "scale", "priority" ask for another


def _check_no_effect_fields(body: dict) -> None:
    """The no-effect fields' shapes, and the settings among them that ask for what Sailfish does not
    do: `store: true` (nothing is stored for later retrieval), another service tier."""
    store = _opt(body, "store", bool, None, "a boolean")
    if store:
        raise _bad("store=true cannot be honoured: Sailfish keeps no stored completions", "store", "unsupported_value")
    metadata = _opt(body, "metadata", dict, None, "an object")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise _bad("'metadata' values must be strings", "metadata", "invalid_type")
    tier = _opt(body, "service_tier", str, None, "a string")
    if tier is not None and tier not in _SERVICE_TIERS:
        raise _bad(f"service_tier {tier!r} cannot be honoured (one tier here: 'auto' or 'default')", "service_tier",
                   "unsupported_value")


def _stream(body: dict, usage: bool = True) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage); `usage`: the API has that option (Responses has not)."""
    stream = _opt(body, "stream", bool, False, "a boolean")
    options = _opt(body, "stream_options", dict, None, "an object")
    if options is not None and not stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    options = options or {}
    for name, value in options.items():
        if name == "include_obfuscation" and value is False:
            continue  # the obfuscation padding off: what is sent anyway
        if name != "include_usage" or not usage:
            raise _bad(f"stream_options.{name} is not supported", "stream_options", "unsupported_value")
    include_usage = _opt(options, "include_usage", bool, False, "a boolean")
    return stream, include_usage


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, null, or a list of text parts (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            is_text = isinstance(part, dict) and part.get("type") in ("text", "input_text")
            if is_text and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif is_text:
                raise _bad(f"{where}.content[{k}].text must be a string", f"{where}.content", "invalid_type")
            elif isinstance(part, dict) and "type" in part:
                raise _bad(f"{where}.content[{k}]: content parts of type {part['type']!r} are not supported "
                           "(text only)", f"{where}.content", "unsupported_value")
            else:
                raise _bad(f"{where}.content[{k}] is not a content part", f"{where}.content", "invalid_type")
        return "".join(parts)
    raise _bad(f"{where}.content must be a string, null or a list of parts", f"{where}.content", "invalid_type")


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"]):
        raise _bad(f"{where}: a tool call needs function.name (letters, digits, _ . : -)", where, "invalid_type")
    arguments = json_arguments(fn.get("arguments"), f"{where}: function.arguments", where)
    return {"id": str(call.get("id") or f"call_{uuid.uuid4().hex[:24]}"), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


def json_arguments(arguments: Any, what: str, param: str) -> str:
    """A tool call's arguments: a JSON string ("{}" when absent) nested at most MAX_JSON_DEPTH deep;
    `what` names them in the 400's message, `param` is its param."""
    if arguments is None:
        return "{}"
    if not isinstance(arguments, str):
        raise _bad(f"{what} must be a JSON string", param, "invalid_type")
    if _string_too_deep(arguments):
        raise _bad(f"{what} is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)", param, "too_deep")
    return arguments


def _string_too_deep(text: str) -> bool:
    """Whether a JSON string nests deeper than MAX_JSON_DEPTH (a cheap bracket count first)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False
    try:
        return json_depth(json.loads(text)) > MAX_JSON_DEPTH
    except RecursionError:
        return True
    except ValueError:
        return False  # not JSON: rendered as a string


def parse_messages(raw: Any) -> list[dict]:
    """Validated, normalized messages: role (developer -> system), content text, tool fields, and an
    assistant message's `reasoning_content` (or `reasoning`) as `reasoning_content`."""
    if raw is None:
        raise APIError(400, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(raw, list):
        raise _bad("'messages' must be an array of messages", "messages", "invalid_type")
    if not raw:
        raise _bad("'messages' must contain at least one message", "messages", "empty_array")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role {role!r} is not one of {', '.join(ROLES)}", f"{where}.role")
        _check_message_keys(m, role, where)
        msg: dict = {"role": "system" if role == "developer" else role,
                     "content": _text_content(m.get("content"), where)}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls must be an array", f"{where}.tool_calls", "invalid_type")
            if calls:
                msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
            reasoning = _reasoning(m, where)
            if reasoning:  # rendered back as the chat format decides (common.chat_format, "Thinking")
                msg["reasoning_content"] = reasoning
            refusal = m.get("refusal")
            if refusal is not None and not isinstance(refusal, str):
                raise _bad(f"{where}.refusal must be a string", f"{where}.refusal", "invalid_type")
            if refusal:  # what the assistant said in refusing: its text in the conversation
                msg["content"] = f"{msg['content']}\n{refusal}" if msg["content"] else refusal
        elif role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise APIError(400, f"{where}: a tool message needs 'tool_call_id'", f"{where}.tool_call_id",
                               "missing_required_parameter")
            msg["tool_call_id"] = m["tool_call_id"]
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{where}.name must be a string", f"{where}.name", "invalid_type")
        if name:
            msg["name"] = name
        out.append(msg)
    check_tool_results(out)
    return out


# An assistant's earlier reasoning, under the names clients give it (`_reasoning`): a string, or a list
# of parts with the text under one of these keys
_REASONING_TEXT_KEYS = ("reasoning_content", "reasoning", "thinking")
_REASONING_PART_KEYS = {"reasoning_details": ("text", "summary"), "thinking_blocks": ("thinking",)}


# A message's keys by role. Beside the ones rendered, a message may carry what holds nothing to
# honour: a null (a client's dump of unset optional fields, as the Responses route takes it), an
# assistant's `prefix` that is off, and what clients keep beside a response's text: `parsed` (the
# openai SDK's parse of the content), `annotations` (citations of the content), LiteLLM's
# `provider_specific_fields`. Anything else is refused by name, as OpenAI refuses it: a `prefix`
# asking to continue the message, a `function_call` or `audio` that was made, a user's tool_call_id.
_MESSAGE_KEYS = {"role", "content", "name", "cache_control"}  # cache_control: proxies add it; the prefix cache is automatic
_ROLE_KEYS = {"assistant": {"tool_calls", "refusal", *_REASONING_TEXT_KEYS, *_REASONING_PART_KEYS},
              "tool": {"tool_call_id"}}
_ASSISTANT_KEPT_BESIDE = {"parsed", "annotations", "provider_specific_fields"}


def _check_message_keys(m: dict, role: str, where: str) -> None:
    allowed = _MESSAGE_KEYS | _ROLE_KEYS.get(role, set())
    for key, value in m.items():
        if key in allowed or value in (None, "", [], {}):   # nothing asked for
            continue
        if role == "assistant" and (key in _ASSISTANT_KEPT_BESIDE or (key == "prefix" and value is False)):
            continue
        if role == "assistant" and key in ("prefix", "function_call", "audio"):
            raise _bad(f"{where}.{key} cannot be honoured: Sailfish does not continue an assistant message, and "
                       "takes tool calls as tool_calls and text as content", f"{where}.{key}", "unsupported_value")
        raise _bad(f"{where}.{key} is not a field of {'an' if role == 'assistant' else 'a'} {role} message",
                   f"{where}.{key}", "unknown_parameter")


def _reasoning(m: dict, where: str) -> str:
    """An assistant message's earlier reasoning, under the names clients give it: the first non-empty
    of `reasoning_content`, `reasoning` (vLLM) and `thinking` (strings), else the parts of
    `reasoning_details` (OpenRouter: `text` or `summary`) or `thinking_blocks` (LiteLLM: `thinking`),
    joined as the Anthropic route joins thinking blocks. Clients that send one text under two names
    (OpenRouter's `reasoning` beside its `reasoning_details`) give it once. The chat format renders it
    back as it renders its own (common.chat_format). A non-empty value of another shape is a 400."""
    for key in _REASONING_TEXT_KEYS:
        value = m.get(key)
        if value in (None, "", []):
            continue
        if not isinstance(value, str):
            raise _bad(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_type")
        return value
    for key, fields in _REASONING_PART_KEYS.items():
        parts = m.get(key)
        if parts in (None, "", []):
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise _bad(f"{where}.{key} must be an array of objects", f"{where}.{key}", "invalid_type")
        # parts without text (encrypted or redacted reasoning) carry nothing to render
        texts = [next((p[f] for f in fields if isinstance(p.get(f), str)), "") for p in parts]
        return "\n\n".join(t for t in texts if t)
    return ""


def check_tool_results(messages: list[dict], param: str = "messages") -> None:
    """A 400 for a tool result (normalized messages) that answers no call: each must answer a call of
    the assistant turn right before its run of results (Anthropic: in the next user message), once,
    as OpenAI's and Anthropic's APIs require. Calls left unanswered are accepted (rendered as they
    are: recorded agent sessions hold them, and the model sees the calls either way)."""
    open_ids: list[str] = []      # the calls of the last assistant turn not answered yet
    for m in messages:
        if m["role"] == "tool":
            call_id = m["tool_call_id"]
            if call_id not in open_ids:
                raise _bad(f"a tool result for {call_id!r} answers no tool call of the assistant turn right "
                           "before it (each result follows the turn with its call, once, before any other "
                           "message)", param, "invalid_tool_result")
            open_ids.remove(call_id)
        else:
            open_ids = [c["id"] for c in m.get("tool_calls", [])] if m["role"] == "assistant" else []


_TOOL_KEYS = {"type", "function", "cache_control"}  # cache_control: what proxies add; no effect here
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def parse_tools(raw: Any) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("'tools' must be an array", "tools", "invalid_type")
    tools, names = [], set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise _bad(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where, "invalid_type")
        for keys, known, at in ((t, _TOOL_KEYS, where), (fn, _FUNCTION_KEYS, f"{where}.function")):
            unknown = sorted(set(keys) - known)
            if unknown:
                raise _bad(f"{at}.{unknown[0]}: unknown field", f"{at}.{unknown[0]}", "unknown_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise _bad(f"{where}.function.name must be 1-128 letters, digits, _ . : or -", f"{where}.function.name")
        if name in names:
            raise _bad(f"{where}: duplicate tool name {name!r}", f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict)
                                   or params.get("type", "object") != "object"):
            raise _bad(f"{where}.function.parameters must be a JSON Schema object with type 'object'",
                       f"{where}.function.parameters", "invalid_function_parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description must be a string", f"{where}.function.description",
                       "invalid_type")
        out = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
        if fn.get("description"):
            out["description"] = fn["description"]
        if _check_strict(fn, out["parameters"], where):
            out["strict"] = True  # (only when set: the built-in format renders name, description and parameters)
        tools.append({"type": "function", "function": out})
    return tools


def strict_calls(tools: list[dict]) -> bool:
    """Whether any of the request's tools (as `parse_tools` gives them) is marked `strict`: its calls
    are then enforced by the grammar under tool_choice "auto" too (server.serving)."""
    return any(t["function"].get("strict") for t in tools)


def check_one_call(parallel: bool, tool_choice: str | dict, strict: bool) -> None:
    """`parallel_tool_calls: false` (one call at most) is refused where nothing enforces it: with
    tool_choice "auto" and no strict tool (server.serving's grammar enforces it otherwise)."""
    if not parallel and tool_choice == "auto" and not strict:
        raise _bad("parallel_tool_calls=false is enforced only with tool_choice 'required', a named function or "
                   "strict tools (with 'auto' the model may call several tools)", "parallel_tool_calls",
                   "unsupported_value")


def _check_strict(fn: dict, parameters: dict, where: str) -> bool:
    """Whether the tool is `strict` (a boolean); a strict tool's schema may use only what the call
    grammar enforces (server.tool_grammars.unenforced_keywords): the rest is refused, not enforced in part."""
    from server.tool_grammars import unenforced_keywords

    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{where}.function.strict must be a boolean", f"{where}.function.strict", "invalid_type")
    unenforced = unenforced_keywords(parameters) if strict else []
    if unenforced:
        raise _bad(f"{where}.function.parameters: {', '.join(unenforced)} cannot be enforced under strict (calls "
                   "follow types, properties, required, enum, const, anyOf/oneOf/allOf, items, minItems 1 and local "
                   "$refs); send strict: false to have them unenforced", f"{where}.function.parameters",
                   "unsupported_value")
    return bool(strict)


def parse_tool_choice(raw: Any, tools: list[dict]) -> str | dict:
    """'none', 'auto', 'required' or {"name": NAME}; 'auto' when tools are given, else 'none'."""
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto", "required"):
        if raw == "required" and not tools:
            raise _bad("tool_choice 'required' needs at least one tool in 'tools'", "tool_choice")
        return raw
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise _bad(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
    return {"name": name}


def _response_format(body: dict) -> dict | None:
    """None for text; {"type": "json_object"}; {"type": "json_schema", "schema": S} (from json_schema.schema)."""
    fmt = _opt(body, "response_format", dict, {"type": "text"}, "an object")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format json_schema needs json_schema.schema, a JSON Schema object",
                       "response_format", "invalid_value")
        return {"type": "json_schema", "schema": schema}
    raise _bad(f"response_format {kind!r} is not supported (text, json_object or json_schema)", "response_format",
               "unsupported_value")


# ---------------------------------------------------------------- requests

_SAMPLING_FIELDS = {*_SAMPLING_RANGES, "top_k", "n", "seed"}
_CHAT_FIELDS = {"messages", "model", "max_tokens", "max_completion_tokens", "logprobs", "response_format", "stop",
                "stream", "tools", "tool_choice", "parallel_tool_calls", *_SAMPLING_FIELDS}
_COMPLETION_FIELDS = {"prompt", "model", "max_tokens", "max_completion_tokens", "echo", "logprobs", "best_of", "stop", "stream",
                      *_SAMPLING_FIELDS}

@dataclass
class ChatCompletionRequest:
    messages: list[dict]
    model: str = ""
    max_tokens: int | None = None        # max_completion_tokens, else max_tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False          # stream_options.include_usage
    sampling: SamplingParams = SamplingParams()  # greedy unless asked (or the model's defaults say so)
    tool_choice: str | dict = "none"
    tools: list[dict] = field(default_factory=list)
    user: str | None = None
    response_format: dict | None = None  # None: text; {"type": "json_object"} or {"type": "json_schema", "schema": S}
    parallel_tool_calls: bool = True
    strict_calls: bool = False           # a tool is `strict`: calls enforced under tool_choice "auto" too
    max_tokens_field: str = "max_tokens"  # the limit's name in the request (errors name it)

    @classmethod
    def parse(cls, body: Any, sampling_defaults: dict | None = None) -> "ChatCompletionRequest":
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_type")
        _refuse_unknown(body, _CHAT_FIELDS)
        messages = parse_messages(body.get("messages"))
        model = _opt(body, "model", str, "", "a string")
        if _opt(body, "logprobs", bool, False, "a boolean"):
            raise _bad("logprobs are not supported", "logprobs", "unsupported_value")
        max_tokens = _max_tokens(body)
        response_format = _response_format(body)
        sampling = _sampling(body, sampling_defaults)
        stop = _stop(body)
        stream, include_usage = _stream(body)
        tools = parse_tools(body.get("tools"))
        strict = strict_calls(tools)
        tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
        parallel = _opt(body, "parallel_tool_calls", bool, True, "a boolean")
        check_one_call(parallel, tool_choice, strict)
        if response_format is not None and tool_choice not in ("none", "auto"):
            raise _bad("a JSON response_format and a required tool call cannot both be enforced", "response_format",
                       "unsupported_value")
        user = _opt(body, "user", str, None, "a string")
        return cls(messages, model, max_tokens, sampling.seed, stop, stream, include_usage, sampling,
                   tool_choice, tools, user, response_format, parallel, strict, _max_tokens_field(body))


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    model: str = ""
    max_tokens: int = 16                 # max_completion_tokens, else max_tokens; the OpenAI default 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingParams = SamplingParams()
    user: str | None = None
    max_tokens_field: str = "max_tokens"

    @classmethod
    def parse(cls, body: Any, sampling_defaults: dict | None = None) -> "CompletionRequest":
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_type")
        _refuse_unknown(body, _COMPLETION_FIELDS)
        model = _opt(body, "model", str, "", "a string")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        is_ids = (isinstance(prompt, list) and bool(prompt)
                  and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
        if prompt is None:
            raise APIError(400, "Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
        if not (isinstance(prompt, str) and prompt) and not is_ids:
            raise _bad("'prompt' must be a non-empty string or token id array (batches of one only)", "prompt")
        if is_ids and min(prompt) < 0:
            raise _bad("token ids in 'prompt' must not be negative", "prompt")
        if body.get("echo"):
            raise _bad("echo is not supported", "echo", "unsupported_value")
        if body.get("logprobs") is not None:
            raise _bad("logprobs are not supported", "logprobs", "unsupported_value")
        if body.get("best_of") is not None and body.get("best_of") != 1:
            raise _bad("only best_of=1 is supported", "best_of", "unsupported_value")
        max_tokens = _max_tokens(body) or 16
        sampling = _sampling(body, sampling_defaults)
        stop = _stop(body)
        stream, include_usage = _stream(body)
        user = _opt(body, "user", str, None, "a string")
        return cls(prompt, model, max_tokens, sampling.seed, stop, stream, include_usage, sampling, user,
                   _max_tokens_field(body))


# ---------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def usage_body(prompt_tokens: int, completion_tokens: int, sailfish: dict, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts prompt tokens whose KV
    came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}, "sailfish": sailfish}


def chat_completion(rid: str, model: str, message: dict, finish_reason: str, usage: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage, "system_fingerprint": None}


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               usage: dict | None = None, include_usage: bool = False) -> dict:
    """A stream chunk; delta None makes the usage-only final chunk (empty choices)."""
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": None,
             "choices": [] if delta is None else
             [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = usage
    return chunk


def completion(rid: str, model: str, created: int, text: str, finish_reason: str | None,
               usage: dict | None, include_usage: bool = True) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [] if text is None else
            [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if include_usage:
        body["usage"] = usage
    return body


def model_list(model_id: str, created: int, context_length: int | None = None) -> dict:
    """The model list; `max_model_len` (vLLM's name) and `context_length` give the served context."""
    return {"object": "list", "data": [model_entry(model_id, created, context_length)]}


def model_entry(model_id: str, created: int, context_length: int | None = None) -> dict:
    """One model object (GET /v1/models/{id} answers with it; the list holds the loaded model's)."""
    entry = {"id": model_id, "object": "model", "created": created, "owned_by": "sailfish"}
    if context_length is not None:
        entry.update(max_model_len=context_length, context_length=context_length)
    return entry
