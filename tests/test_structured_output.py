"""Enforced formats through the real server on the bundled 270M base model (which follows no
instruction on its own): a json_schema response_format parses and validates on 20 of 20 requests, a
required tool call comes back as tool_calls on 20 of 20, and drafted constrained output equals plain
constrained output, greedy and seeded sampling alike.
"""
from __future__ import annotations

import json

import openai
import pytest

from bench.live_server import ServerThread
from ngram.drafter import DrafterConfig, NgramDrafter
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.serving import Service
from server.settings import Settings

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "role": {"enum": ["admin", "user", "guest"]}}}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "required": ["path"],
                                                          "properties": {"path": {"type": "string", "maxLength": 40}}}}},
         {"type": "function", "function": {"name": "list_dir", "description": "List a directory",
                                           "parameters": {"type": "object", "properties": {
                                               "depth": {"type": "integer"}}}}}]
ASKS = [f"Describe user number {i} of the {topic} team." for i, topic in
        enumerate(["web", "data", "ops", "ml", "mobile"] * 4)]


@pytest.fixture(scope="module")
def servers():
    from server.model_loading import load_target

    target = load_target(None)
    drafted = Service(Engine(target, NgramDrafter(None, DrafterConfig()), EngineConfig(adaptive=False)),
                      Settings(trace_log=False))
    plain = Service(Engine(target, None, EngineConfig(adaptive=False)), Settings(trace_log=False, draft=False))
    with ServerThread(create_app(drafted)) as a, ServerThread(create_app(plain)) as b:
        yield (openai.OpenAI(base_url=a + "/v1", api_key="x", max_retries=0, timeout=300),
               openai.OpenAI(base_url=b + "/v1", api_key="x", max_retries=0, timeout=300))


def _valid_person(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "role"} and isinstance(value["name"], str)
            and len(value["name"]) <= 16 and isinstance(value["age"], int) and 0 <= value["age"] <= 150 and value["role"] in ("admin", "user", "guest"))


def test_json_schema_replies_parse_and_validate_20_of_20(servers):
    drafted, _ = servers
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for ask in ASKS:
        r = drafted.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}],
                                            response_format=fmt, max_tokens=96)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert _valid_person(json.loads(r.choices[0].message.content)), r.choices[0].message.content


def test_json_object_replies_parse(servers):
    drafted, _ = servers
    for ask in ASKS[:5]:
        r = drafted.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}],
                                            response_format={"type": "json_object"}, max_tokens=64)
        if r.choices[0].finish_reason == "stop":  # an object may be longer than max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_required_tool_choice_yields_tool_calls_20_of_20(servers):
    drafted, _ = servers
    for k, ask in enumerate(ASKS):
        choice = "required" if k % 2 else {"type": "function", "function": {"name": "read_file"}}
        r = drafted.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}], tools=TOOLS,
                                            tool_choice=choice, parallel_tool_calls=False, max_tokens=64)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        assert calls[0].function.name in ("read_file", "list_dir")
        assert isinstance(json.loads(calls[0].function.arguments), dict)
        if not isinstance(choice, str):
            assert calls[0].function.name == "read_file" and "path" in json.loads(calls[0].function.arguments)


def test_a_stop_sequence_does_not_cut_an_enforced_call(servers):
    """A request's stop strings end the text, not a call it enforces: ':' and '}' stand in every Gemma
    call (`call:read_file{path:...}`), and the enforced call still comes back whole, through the
    openai and the anthropic clients (it came back cut: Messages answered `input: {}` with
    stop_reason "stop_sequence"). Under auto a call is cut like text
    (tests/test_streaming_calls.py)."""
    import anthropic

    drafted, _ = servers
    ask = [{"role": "user", "content": ASKS[0]}]
    r = drafted.chat.completions.create(model="m", messages=ask, tools=TOOLS, max_tokens=64, stop=[":", "}"],
                                        tool_choice={"type": "function", "function": {"name": "read_file"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0].message
    assert calls[0].function.name == "read_file" and "path" in json.loads(calls[0].function.arguments)
    base = str(drafted.base_url).rstrip("/").removesuffix("/v1")
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    # one call (left free to write more, the base model writes calls until max_tokens)
    for choice in ({"type": "tool", "name": "read_file"}, {"type": "any", "disable_parallel_tool_use": True}):
        m = client.messages.create(model="m", max_tokens=64, messages=ask, tools=tools, tool_choice=choice,
                                   stop_sequences=[":", "}"])
        assert (m.stop_reason, m.stop_sequence, m.content[-1].type) == ("tool_use", None, "tool_use"), m
        if choice["type"] == "tool":
            assert m.content[-1].name == "read_file" and "path" in m.content[-1].input


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}])
def test_drafted_constrained_equals_plain_constrained(servers, sampling):
    drafted, plain = servers
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    accepted = 0
    for ask in ASKS[:2]:
        kw = dict(model="m", messages=[{"role": "user", "content": ask}], max_tokens=96, **sampling)
        a = drafted.chat.completions.create(response_format=fmt, **kw)
        b = plain.chat.completions.create(response_format=fmt, **kw)
        assert a.choices[0].message.content == b.choices[0].message.content
        accepted += a.usage.model_extra["sailfish"]["accepted_tokens"]
        a = drafted.chat.completions.create(tools=TOOLS, tool_choice="required", **kw)
        accepted += a.usage.model_extra["sailfish"]["accepted_tokens"]
        b = plain.chat.completions.create(tools=TOOLS, tool_choice="required", **kw)
        assert a.choices[0].message.model_dump(exclude={"tool_calls"}) == b.choices[0].message.model_dump(
            exclude={"tool_calls"})
        assert [(c.function.name, c.function.arguments) for c in a.choices[0].message.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in b.choices[0].message.tool_calls or []]
    assert accepted > 0  # the drafted server's drafts were taken (from the live context: no index here)


def test_unenforceable_formats_get_a_400(servers):
    drafted, _ = servers
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError):
        drafted.chat.completions.create(model="m", messages=hi, max_tokens=8,
                                        response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(openai.BadRequestError):
        drafted.chat.completions.create(model="m", messages=hi, max_tokens=8, tools=TOOLS, tool_choice="required",
                                        response_format={"type": "json_object"})
    assert drafted.chat.completions.create(model="m", messages=hi, max_tokens=4).choices[0].message is not None


GEMMA4_STYLE_TEMPLATE = (  # a chat template that renders tools and writes calls in Gemma 4's syntax
    "{{ bos_token }}{% if tools %}<|turn>system\n{% for t in tools %}declaration:{{ t.function.name }}\n"
    "{% endfor %}Call a tool as <|tool_call>call:NAME{...}<tool_call|><turn|>\n{% endif %}"
    "{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def test_a_required_call_is_enforced_under_a_chat_template_that_writes_gemma_calls():
    import copy
    import dataclasses

    from common.chat_format import ChatFormat
    from server.model_loading import load_target

    target = load_target(None)
    tokenizer = copy.deepcopy(target.tokenizer)
    tokenizer.chat_template = GEMMA4_STYLE_TEMPLATE
    assert ChatFormat.for_tokenizer(tokenizer).uses_template and ChatFormat.for_tokenizer(tokenizer).writes_gemma_calls
    other = copy.deepcopy(tokenizer)
    other.chat_template = GEMMA4_STYLE_TEMPLATE.replace("<|tool_call>call:NAME{...}<tool_call|>", "JSON")
    assert not ChatFormat.for_tokenizer(other).writes_gemma_calls  # its calls cannot be enforced by the grammar
    templated = dataclasses.replace(target, tokenizer=tokenizer)
    service = Service(Engine(templated, None, EngineConfig(adaptive=False)), Settings(trace_log=False))
    with ServerThread(create_app(service)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        for ask in ASKS[:5]:
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}], tools=TOOLS,
                                               tool_choice="required", parallel_tool_calls=False, max_tokens=64)
            assert r.choices[0].message.tool_calls and r.choices[0].finish_reason == "tool_calls"


def test_count_tokens_counts_the_prompt_an_enforced_call_is_generated_from(servers):
    """count_tokens renders as generation does: under tool_choice any / tool the grammar writes the call
    from its first token, so the prompt has no forced call prefix (the count had it: 103 against 95)."""
    import httpx

    base = str(servers[0].base_url).rstrip("/").removesuffix("/v1")
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "required": ["city"],
                                                      "properties": {"city": {"type": "string"}}}}]
    messages = [{"role": "user", "content": "Call get_weather for Paris now."}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}):
        body = {"model": "m", "messages": messages, "tools": tools, "tool_choice": choice}
        counted = httpx.post(base + "/v1/messages/count_tokens", json=body, timeout=300).json()["input_tokens"]
        usage = httpx.post(base + "/v1/messages", json=dict(body, max_tokens=4), timeout=300).json()["usage"]
        assert counted == usage["input_tokens"] + usage["cache_read_input_tokens"], choice
