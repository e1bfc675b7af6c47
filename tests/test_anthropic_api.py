"""The Anthropic Messages API (server.anthropic_api), driven with the official `anthropic` client over
real HTTP. Like test_server_protocol.py it serves the SCRIPTED STAND-IN ENGINE (`ScriptedEngine`, see
there): fixed Gemma 4 text, tool calls included, against the real rendered prompt. The requests are
shaped like Claude Code's (system blocks with cache_control, the billing header, metadata, adaptive
thinking, context_management).
"""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from bench.live_server import ServerThread
from server.app import create_app
from server.serving import Service
from server.settings import Settings
from tests.test_server_protocol import ScriptedEngine, _serve, serving

WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME_TOOL = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}
HI = [{"role": "user", "content": "hi"}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
HELLO = "Hello there! How can I help you today?"


@pytest.fixture(scope="module")
def server():
    yield from serving(ScriptedEngine())


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[2], api_key="unused", max_retries=0)


def _dump(message) -> dict:
    """A client's Message as the plain dict the server sent (for comparing streamed and whole answers)."""
    body = message.model_dump(exclude_none=True)
    body["usage"] = {k: v for k, v in body["usage"].items() if k != "sailfish"}
    return body


def test_text_reply_in_anthropic_shape(server, client):
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37; cch=fa690;"},
              {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    r = client.messages.create(model="claude-sonnet-4-5", max_tokens=100, messages=HI, system=system,
                               metadata={"user_id": "someone"})
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == "scripted-stand-in"
    assert [(b.type, b.text) for b in r.content] == [("text", HELLO)]
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.cache_read_input_tokens == 0 and r.usage.cache_creation_input_tokens == 0
    assert "drafted_tokens" in r.usage.model_extra["sailfish"]
    prompt = server[0].prompts[-1]
    assert prompt.startswith("<bos><|turn>system\nBe brief.<turn|>\n") and "billing-header" not in prompt
    assert 'sailfish_requests_total{endpoint="messages",outcome="ok"}' in httpx.get(server[2] + "/metrics").text


def test_max_tokens_and_stop_sequences(client):
    r = client.messages.create(model="m", max_tokens=2, messages=HI)
    assert (r.stop_reason, r.content[0].text) == ("max_tokens", "Hello ")
    r = client.messages.create(model="m", max_tokens=100, messages=HI, stop_sequences=["never", "!"])
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", "!", "Hello there")
    r = client.messages.create(model="m", max_tokens=100, messages=HI, stop_sequences=["never"],
                               extra_body={"temperature": 0, "top_p": 0.9, "top_k": 5})
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("end_turn", None, HELLO)


def test_stream_event_sequence_and_text_deltas(client):
    whole = client.messages.create(model="m", max_tokens=100, messages=HI)
    events = list(client.messages.create(model="m", max_tokens=100, messages=HI, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and len(kinds) > 6
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens > 0
    assert events[1].content_block.type == "text" and events[1].index == 0
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text == HELLO
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == whole.usage.output_tokens


def test_stream_wire_format(server):
    """`event: TYPE` names each `data:` line's type, as Anthropic's SSE does."""
    body = {"model": "m", "max_tokens": 50, "messages": HI, "stream": True}
    with httpx.stream("POST", server[2] + "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert json.loads(data_line.removeprefix("data: "))["type"] == event_line.removeprefix("event: ")


def test_tool_round_trip(server, client):
    r = client.messages.create(model="m", max_tokens=200, messages=WEATHER, tools=[WEATHER_TOOL])
    assert r.stop_reason == "tool_use"
    text, call = r.content
    assert (text.type, text.text) == ("text", "Let me check. ")
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input == {"city": "Paris"}
    assert "<|tool>declaration:get_weather{description:<|\"|>Current weather in a city<|\"|>" in server[0].prompts[-1]

    history = WEATHER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]}]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": '{"sky": "sunny", "temp_c": 21}'}
    r2 = client.messages.create(model="m", max_tokens=200, tools=[WEATHER_TOOL],
                                messages=history + [{"role": "user", "content": [result]}])
    assert [(b.type, b.text) for b in r2.content] == [("text", "It is sunny in Paris.")]
    assert r2.stop_reason == "end_turn"
    prompt = server[0].prompts[-1]
    assert "Let me check. <|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>" in prompt
    assert prompt.endswith("<|tool_response>response:get_weather{sky:<|\"|>sunny<|\"|>,temp_c:21}<tool_response|>")

    failed = {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
              "content": [{"type": "text", "text": "no such city"}]}
    client.messages.create(model="m", max_tokens=200, tools=[WEATHER_TOOL],
                           messages=history + [{"role": "user", "content": [failed]}])
    assert server[0].prompts[-1].endswith("response:get_weather{error:<|\"|>no such city<|\"|>}<tool_response|>")


def test_tool_use_streams_as_input_json_delta(client):
    events = list(client.messages.create(model="m", max_tokens=200, messages=WEATHER, tools=[WEATHER_TOOL],
                                         stream=True))
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use"] and starts[1].name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    assert events[-2].delta.stop_reason == "tool_use"


def test_tool_choice_any_tool_none(server, client):
    r = client.messages.create(model="m", max_tokens=200, messages=HI, tools=[WEATHER_TOOL, TIME_TOOL],
                               tool_choice={"type": "any"})
    assert r.stop_reason == "tool_use" and r.content[-1].name == "get_time" and r.content[-1].input == {"tz": "UTC"}
    r = client.messages.create(model="m", max_tokens=200, messages=WEATHER, tools=[WEATHER_TOOL],
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert server[0].prompts[-1].endswith("<|tool_call>call:get_weather{") and r.content[-1].input == {"city": "Paris"}
    r = client.messages.create(model="m", max_tokens=200, messages=WEATHER, tools=[WEATHER_TOOL],
                               tool_choice={"type": "none"})
    assert "declaration:get_weather" not in server[0].prompts[-1] and r.stop_reason == "end_turn"


SAME_ANSWER_CASES = [
    dict(messages=HI), dict(messages=HI, max_tokens=3), dict(messages=HI, stop_sequences=["!"]),
    dict(messages=WEATHER, tools=[WEATHER_TOOL]),
    dict(messages=HI, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice={"type": "any"}),
    dict(messages=[{"role": "user", "content": "weather and time, both please"}], tools=[WEATHER_TOOL, TIME_TOOL]),
    dict(messages=[{"role": "user", "content": "weather and time, both please"}], tools=[WEATHER_TOOL, TIME_TOOL],
         max_tokens=20),  # the second call cut off: its text stays content
]


@pytest.mark.parametrize("req", SAME_ANSWER_CASES)
def test_streamed_and_whole_answers_are_the_same(client, req):
    req = {"max_tokens": 200, **req}
    whole = client.messages.create(model="m", **req)
    with client.messages.stream(model="m", **req) as stream:
        streamed = stream.get_final_message()
    a, b = _dump(whole), _dump(streamed)
    a.pop("id"), b.pop("id")
    for body in (a, b):  # tool_use ids are new per answer
        for block in body["content"]:
            block.pop("id", None)
    assert a == b


def test_count_tokens_counts_the_rendered_prompt(server, client):
    req = dict(model="m", messages=WEATHER, tools=[WEATHER_TOOL], system="Be brief.")
    counted = client.messages.count_tokens(**req).input_tokens
    r = client.messages.create(max_tokens=50, **req)
    assert counted == r.usage.input_tokens + r.usage.cache_read_input_tokens == len(server[0].prompts[-1].encode())
    assert counted > client.messages.count_tokens(model="m", messages=WEATHER).input_tokens
    r = httpx.post(server[2] + "/v1/messages/count_tokens", json={"model": "m", "messages": [{"role": "wizard"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_claude_code_shaped_request_is_accepted(server):
    body = {
        "model": "claude-opus-4-6", "max_tokens": 100, "stream": False, "temperature": 1,
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                         {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"},
                                              {"type": "text", "text": "Hello."}]},
            {"role": "system", "content": "The user switched directories."},
            {"role": "user", "content": "hi again"}],
        "tools": [{**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}}],
        "metadata": {"user_id": "user_abc"}, "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}, "cache_control": {"type": "ephemeral"},
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "context-management-2025-06-27,oauth-2025-04-20"}
    r = httpx.post(server[2] + "/v1/messages?beta=true", json=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": HELLO}]
    prompt = server[0].prompts[-1]
    assert "You are a coding agent.\n\nThe user switched directories." in prompt
    assert "<|turn>user\n<system-reminder>ctx</system-reminder>\n\nhi<turn|>" in prompt
    assert "hmm" not in prompt and "<|turn>model\nHello.<turn|>" in prompt
    r = httpx.post(server[2] + "/v1/messages/count_tokens?beta=true", headers=headers,
                   json={k: v for k, v in body.items() if k not in ("max_tokens", "stream")})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def _error_of(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    return body["error"]["message"]


def test_what_needs_a_grammar_is_refused_where_none_can_run(server):
    """disable_parallel_tool_use with any / tool (one call at most, as parallel_tool_calls: false on
    the OpenAI route) and strict tools are enforced by a grammar (the 270M server tests run them);
    this scripted engine's tokenizer cannot run one, so they are refused, not ignored. With plain
    auto, disable_parallel_tool_use is refused anywhere (above)."""
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
        message = _error_of(httpx.post(server[2] + "/v1/messages", json={
            "model": "m", "max_tokens": 50, "messages": WEATHER, "tools": [WEATHER_TOOL], "tool_choice": choice}),
            400, "invalid_request_error")
        assert "one call at most (parallel_tool_calls: false) cannot be enforced" in message
    strict = {**WEATHER_TOOL, "strict": True}
    message = _error_of(httpx.post(server[2] + "/v1/messages", json={
        "model": "m", "max_tokens": 50, "messages": WEATHER, "tools": [strict]}), 400, "invalid_request_error")
    assert "strict tools cannot be enforced" in message


@pytest.mark.parametrize("body, says", [
    ({"messages": HI}, "max_tokens"),
    ({"max_tokens": 0, "messages": HI}, "max_tokens"),
    ({"max_tokens": "10", "messages": HI}, "max_tokens"),
    ({"max_tokens": 10}, "messages"),
    ({"max_tokens": 10, "messages": []}, "messages"),
    ({"max_tokens": 10, "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"max_tokens": 10, "messages": [{"role": "tool", "content": "hi"}]}, "role"),
    ({"max_tokens": 10, "messages": HI + [{"role": "assistant", "content": "The answer is ("}]}, "prefill"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "document"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": {}}]}]}]}, "image"),
    ({"max_tokens": 10, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}, *HI]}, "tool_result"),
    ({"max_tokens": 10, "messages": HI, "some_vendor_field": 1}, "some_vendor_field"),
    ({"max_tokens": 10, "messages": HI, "tools": [WEATHER_TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 10, "messages": HI, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 10, "messages": HI, "tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
     "nope"),
    ({"max_tokens": 10, "messages": HI, "tools": [WEATHER_TOOL],
      "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "disable_parallel_tool_use"),
    ({"max_tokens": 10, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tools"),
    ({"max_tokens": 10, "messages": HI, "tools": [{"name": "f"}]}, "input_schema"),
    ({"max_tokens": 10, "messages": HI, "tools": [{"name": "f", "strict": True, "input_schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}}]},
     "tools.0.input_schema: pattern cannot be enforced under strict"),
    ({"max_tokens": 10, "messages": HI, "tools": [{"name": "f", "strict": "yes", "input_schema": {"type": "object"}}]},
     "tools.0.strict must be a boolean"),
    ({"max_tokens": 10, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 2048}}, "MAX_THINKING_TOKENS"),
    ({"max_tokens": 10, "messages": HI, "temperature": 7}, "temperature"),
    ({"max_tokens": 10, "messages": HI, "stop_sequences": "!"}, "stop_sequences"),
    ({"max_tokens": 10, "messages": HI, "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "format"),
    ({"max_tokens": 10, "messages": HI, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
     "clear_tool_uses"),
    ({"max_tokens": 10**9, "messages": HI}, "max_tokens"),
    ({"model": None, "max_tokens": 10, "messages": HI}, "model: Field required"),
])
def test_bad_requests_get_anthropic_errors(server, body, says):
    message = _error_of(httpx.post(server[2] + "/v1/messages", json={"model": "m", **body}), 400,
                        "invalid_request_error")
    assert says in message


def test_malformed_bodies_unknown_routes_and_the_server_keeps_serving(server, client):
    r = httpx.post(server[2] + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert "not valid JSON" in _error_of(r, 400, "invalid_request_error")
    _error_of(httpx.post(server[2] + "/v1/messages", json=["a list"]), 400, "invalid_request_error")
    _error_of(httpx.post(server[2] + "/v1/messages/batches", json={}), 404, "not_found_error")
    assert httpx.get(server[2] + "/v1/messages").status_code == 405
    _error_of(httpx.get(server[2] + "/v1/messages"), 405, "invalid_request_error")
    assert set(httpx.get(server[2] + "/v1/nothing-here").json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=10, messages=HI, extra_body={"bogus": 1})
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    assert client.messages.create(model="m", max_tokens=100, messages=HI).content[0].text == HELLO


@pytest.mark.parametrize("fields, says", [
    ({"messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]}, "type: must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]}, "type: must be a string"),
    ({"system": [{"type": ["text"], "text": "x"}]}, "type: must be a string"),
    ({"temperature": 1.5}, "temperature"),   # Anthropic's range is 0-1 (the OpenAI route's 0-2)
    ({"temperature": -1}, "temperature: must be between 0 and 1"),   # said "at most 2" before
    ({"top_k": -1}, "top_k"),
    ({"metadata": {"user_id": 123}}, "metadata.user_id: must be a string"),   # accepted before
    ({"metadata": {"user_id": "u", "foo": "bar"}}, "metadata.foo: Extra inputs are not permitted"),
])
def test_what_anthropic_refuses_is_a_400_not_a_500(server, fields, says):
    body = {"model": "m", "max_tokens": 10, "messages": HI, **fields}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert says in _error_of(httpx.post(server[2] + path, json=body), 400, "invalid_request_error")


def test_engine_failure_is_a_generic_error_streamed_or_not(server, client):
    crash = [{"role": "user", "content": "crash please"}]
    with pytest.raises(anthropic.InternalServerError) as e:
        client.messages.create(model="m", max_tokens=10, messages=crash)
    assert e.value.body["error"]["type"] == "api_error" and "secret" not in json.dumps(e.value.body)
    with httpx.stream("POST", server[2] + "/v1/messages",
                      json={"model": "m", "max_tokens": 10, "messages": crash, "stream": True}) as r:
        frames = [f for f in r.read().decode().split("\n\n") if f]
    assert frames[0].startswith("event: message_start") and frames[-1].startswith("event: error\n")
    error = json.loads(frames[-1].split("data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error" and "secret" not in frames[-1]
    assert client.messages.create(model="m", max_tokens=100, messages=HI).content[0].text == HELLO


def test_prompt_longer_than_context_is_an_anthropic_400():
    service, thread = _serve(ScriptedEngine(max_context=64))
    with thread as url:
        c = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "x" * 100}])
        assert "maximum context length" in e.value.body["error"]["message"]


def test_api_key_as_x_api_key_or_bearer(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    service = Service(ScriptedEngine(), Settings(api_key="sekret", trace_log=False))
    with ServerThread(create_app(service)) as url:
        # this client sends an api_key as a Bearer token; Claude Code sends ANTHROPIC_API_KEY as x-api-key
        by_header = anthropic.Anthropic(base_url=url, default_headers={"x-api-key": "sekret"}, max_retries=0)
        by_bearer = anthropic.Anthropic(base_url=url, auth_token="sekret", max_retries=0)
        for c, sent in ((by_header, "x-api-key"), (by_bearer, "authorization")):
            r = c.messages.with_raw_response.create(model="m", max_tokens=50, messages=HI)
            assert set(r.http_request.headers) & {"x-api-key", "authorization"} == {sent}
            assert r.parse().content[0].text == HELLO
            assert c.messages.count_tokens(model="m", messages=HI).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model="m", max_tokens=50, messages=HI)
        assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
        body = {"model": "m", "max_tokens": 5, "messages": HI}
        _error_of(httpx.post(url + "/v1/messages", json=body), 401, "authentication_error")
        _error_of(httpx.post(url + "/v1/messages/count_tokens", json=body), 401, "authentication_error")
        # x-api-key is the Messages API's header only; the OpenAI routes keep theirs
        r = httpx.get(url + "/v1/models", headers={"x-api-key": "sekret"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer sekret"}).status_code == 200


def test_the_engine_names_the_stop_string_it_cut_at():
    """stop_sequence comes from the real engine's TextStream (the stand-in engine above mimics it)."""
    from server.engine import TextStream
    from tests.test_server_protocol import ByteTokenizer

    stream = TextStream(ByteTokenizer(), ("<turn|>", "END", "!"), [])
    fed = next(i for i, b in enumerate(b"Hi END!") if stream.add(b))  # the engine stops at the first True
    assert fed == len("Hi END") - 1 and stream.stopped_by == "END" and stream.take(True) == "Hi "
    plain = TextStream(ByteTokenizer(), ("END",), [])
    assert not any(plain.add(b) for b in b"no stop here") and plain.stopped_by is None


def test_a_tool_result_answering_no_tool_use_is_a_400(client):
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}
    ok = client.messages.create(model="m", max_tokens=8, messages=[
        {"role": "user", "content": "hi"}, use,
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}]}])
    assert ok.type == "message"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="m", max_tokens=8, messages=[
            {"role": "user", "content": "hi"}, use,
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "r"}]}])
    assert "'nope' answers no tool call" in bad.value.body["error"]["message"]
