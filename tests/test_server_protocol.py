"""The OpenAI protocol of the server, driven with the official `openai` client over real HTTP.

The bundled model is a base model that never emits tool calls, so these tests serve a SCRIPTED
STAND-IN ENGINE (`ScriptedEngine`): it emits fixed Gemma 4 text (tool calls included) a few
characters per "token", honouring max_tokens, stop strings and cancellation like the real engine.
It sees the real rendered prompt (a byte tokenizer), so prompt rendering is checked too. The real
model path is in test_server_model.py.
"""
from __future__ import annotations

import json
import re
import os
import stat
import threading
import time

import httpx
import openai
import pytest

from bench.live_server import ServerThread
from server.app import create_app
from server.engine import GenerationChunk, RequestStats, first_stop
from server.serving import Service
from server.settings import Settings

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
PARIS_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255); enough for ChatFormat and the server."""

    bos_token = "<bos>"
    eos_token_id = 256
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def get_vocab(self) -> dict:
        return {"<eos>": 256}


def default_script(prompt: str) -> str:
    """What the stand-in model says, chosen from the rendered prompt."""
    if prompt.endswith("call:get_weather{"):                     # tool_choice named: prefilled
        return 'city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
    if prompt.endswith("<|tool_call>call:"):                      # tool_choice required: prefilled
        return 'get_time{tz:<|"|>UTC<|"|>}<tool_call|><|tool_response>'
    if prompt.endswith("<tool_response|>"):                       # after a tool result
        return "It is sunny in Paris.<turn|>"
    last_user = prompt.rsplit("<|turn>user\n", 1)[-1]
    if "both" in last_user:
        return PARIS_CALL + '<|tool_call>call:get_time{tz:<|"|>Europe/Paris<|"|>}<tool_call|><|tool_response>'
    if "weather" in last_user and "<|tool>declaration:get_weather" in prompt:
        return "Let me check. " + PARIS_CALL + "<|tool_response>"
    if "crash" in last_user:
        raise RuntimeError("scripted engine failure with a secret stack frame")
    if "dead end" in last_user:  # a grammar that compiled and then allows nothing (server.grammar)
        from server.grammar import GrammarError
        raise GrammarError("the grammar allows no token here and is not complete")
    return "Hello there! How can I help you today?<turn|>"


class ScriptedEngine:
    """A stand-in for server.engine.Engine that replays scripted text instead of running a model."""

    model_id = "scripted-stand-in"
    _drafter = None  # as the real engine's when drafting is off

    def __init__(self, script=default_script, max_context: int = 8192, delay: float = 0.0):
        self.tokenizer = ByteTokenizer()
        self.script, self.max_context, self.delay = script, max_context, delay
        self.prompts: list[str] = []
        self.log: list[tuple[str, int, bool]] = []   # (prompt tail, tokens emitted, stopped early)
        self.lock = threading.Lock()

    def prefix_summary(self):
        return None  # no KV cache to keep

    def batch_summary(self):
        return None  # one request at a time: nothing shares a forward

    def generate(self, prompt_ids, params, cancelled=None):
        prompt = self.tokenizer.decode(prompt_ids)
        with self.lock:
            self.prompts.append(prompt)
        text = self.script(prompt)
        finish, stop_string = "stop", None
        # where the real engine's TextStream would cut (server.engine.first_stop)
        cut = first_stop(text, 0, tuple(params.stop_strings), tuple(params.text_stop_strings), params.call_markers,
                         params.in_call)
        if cut:
            at, stop_string = cut
            text = text[:at]
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        if len(pieces) > params.max_tokens:
            pieces, finish = pieces[:params.max_tokens], "length"
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        emitted, stopped_early = 0, True   # stays True when the server closes this generator
        try:
            for i, piece in enumerate(pieces):
                if self.delay:
                    time.sleep(self.delay)
                stats.completion_tokens += 1
                emitted += 1
                last = i == len(pieces) - 1
                yield GenerationChunk([i], piece, finish if last else None, stats,
                                      stop_string if last and finish == "stop" else None)
                if cancelled is not None and cancelled():
                    return
            if not pieces:
                yield GenerationChunk([], "", finish, stats, stop_string if finish == "stop" else None)
            stopped_early = False
        finally:
            self.log.append((prompt[-40:], emitted, stopped_early))


def _serve(engine, **settings):
    settings.setdefault("trace_log", False)
    service = Service(engine, Settings(**settings))
    return service, ServerThread(create_app(service))


def serving(engine, **settings):
    """(engine, service, base url) while a real server serves `engine` (for module fixtures)."""
    service, thread = _serve(engine, **settings)
    with thread as url:
        yield engine, service, url


@pytest.fixture(scope="module")
def server():
    yield from serving(ScriptedEngine())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[2] + "/v1", api_key="unused", max_retries=0)


def _weather(**kw):
    return dict(model="any-model-name", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[WEATHER_TOOL], **kw)


def test_models_and_any_model_name(client):
    assert [m.id for m in client.models.list().data] == ["scripted-stand-in"]
    # retrieve: the loaded model, under whatever name the client asks for (every name is served)
    for name in ("scripted-stand-in", "gpt-4o", "org/model:tag"):
        got = client.models.retrieve(name)
        assert (got.id, got.object, got.owned_by) == (name, "model", "sailfish")
    r = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert r.model == "scripted-stand-in"
    assert r.choices[0].message.content == "Hello there! How can I help you today?"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "drafted_tokens" in r.usage.model_extra["sailfish"]


def test_tool_call_non_streaming(server, client):
    r = client.chat.completions.create(**_weather())
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = server[0].prompts[-1]
    assert "<|tool>declaration:get_weather{description:<|\"|>Current weather in a city<|\"|>" in prompt
    assert prompt.endswith("<|turn>model\n")


def test_tool_call_streaming_deltas_and_usage(client):
    stream = client.chat.completions.create(**_weather(stream=True, stream_options={"include_usage": True}))
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me check. "
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_parallel_calls_streaming_and_not(client):
    req = dict(model="m", messages=[{"role": "user", "content": "weather and time, both please"}],
               tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=True)
    r = client.chat.completions.create(**req)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert r.choices[0].message.content is None
    assert len({c.id for c in calls}) == 2
    merged: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**req, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            m = merged.setdefault(d.index, {"name": "", "arguments": ""})
            m["name"] += d.function.name or ""
            m["arguments"] += d.function.arguments or ""
    assert [merged[i]["name"] for i in sorted(merged)] == ["get_weather", "get_time"]
    assert json.loads(merged[1]["arguments"]) == {"tz": "Europe/Paris"}


def test_tool_results_in_history(server, client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "temp_c": 21}'},
    ]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    prompt = server[0].prompts[-1]
    assert "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>" in prompt
    assert prompt.endswith("<|tool_response>response:get_weather{sky:<|\"|>sunny<|\"|>,temp_c:21}<tool_response|>")


def test_tool_choice_none_named_required(server, client):
    r = client.chat.completions.create(**_weather(tool_choice="none"))
    assert "declaration:get_weather" not in server[0].prompts[-1]
    assert r.choices[0].message.tool_calls is None
    r = client.chat.completions.create(**_weather(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert server[0].prompts[-1].endswith("<|turn>model\n<|tool_call>call:get_weather{")
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    assert r.choices[0].message.tool_calls[0].function.name == "get_time"
    assert r.choices[0].finish_reason == "tool_calls"


def test_limits_stop_and_ignored_fields(client):
    hi = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="m", messages=hi, max_completion_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == "Hello "
    r = client.chat.completions.create(model="m", messages=hi, stop=["!"])
    assert r.choices[0].message.content == "Hello there"
    r = client.chat.completions.create(model="m", messages=hi, stop="How", store=False, metadata={"a": "b"},
                                       parallel_tool_calls=False, logprobs=False, user="u1", seed=3, n=1,
                                       temperature=0, top_p=1.0, frequency_penalty=0, service_tier="auto",
                                       modalities=["text"])
    assert r.choices[0].message.content == "Hello there! "
    # The no-effect fields' settings that ask for something not done, and their wrong shapes, are refused.
    for fields, param in [({"store": True}, "store"), ({"store": "x"}, "store"), ({"metadata": 5}, "metadata"),
                          ({"metadata": {"a": 5}}, "metadata"), ({"service_tier": "priority"}, "service_tier"),
                          ({"service_tier": 5}, "service_tier"), ({"modalities": ["text", "audio"]}, "modalities"),
                          ({"stream_options": {"include_usage": True}}, "stream_options")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=hi, extra_body=fields)
        assert e.value.body["param"] == param, fields
    with pytest.raises(openai.BadRequestError) as e:  # an option of the stream not sent
        list(client.chat.completions.create(model="m", messages=hi, stream=True,
                                            stream_options={"include_usage": True, "bogus": 1}))
    assert e.value.body["param"] == "stream_options"
    # A field that cannot be honoured is refused, never ignored (issue: sampled drafting).
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=hi, extra_body={"some_vendor_field": {"x": 1}})
    assert e.value.body["code"] == "unknown_parameter" and e.value.body["param"] == "some_vendor_field"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=hi, tools=[tool], parallel_tool_calls=False)
    assert e.value.body["param"] == "parallel_tool_calls"


def test_strict_tools_are_enforced_or_refused(client):
    """`strict` asks that calls follow the schema: refused where it cannot be (a schema keyword the
    call grammar does not enforce; a tokenizer with no grammar compiler, as this scripted engine's),
    never accepted and ignored."""
    hi = [{"role": "user", "content": "hi"}]

    def tool(parameters: dict, strict) -> dict:
        return {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": strict}}

    plain = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}
    for tools, param, says in [
            ([tool({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}, True)],
             "tools[0].function.parameters", "pattern cannot be enforced under strict"),
            ([tool(plain, "yes")], "tools[0].function.strict", "must be a boolean"),
            ([tool(plain, True)], "tools", "strict tools cannot be enforced")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=hi, tools=tools)
        assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body
    r = client.chat.completions.create(model="m", messages=hi, tools=[tool(plain, False)])
    assert r.choices[0].message.content == "Hello there! How can I help you today?"


def test_completions_endpoint(client):
    r = client.completions.create(model="m", prompt="Say hello", max_tokens=4)
    assert r.object == "text_completion" and r.choices[0].text == "Hello there!"
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="m", prompt="Say hello", max_tokens=50, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("Hello there! How can I help")
    assert chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 7}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": "nope"}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_bad_requests_get_openai_errors(server, body, param):
    r = httpx.post(server[2] + "/v1/chat/completions", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_json_unknown_route_and_client_errors(server, client):
    r = httpx.post(server[2] + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(server[2] + "/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[])
    assert e.value.status_code == 400 and e.value.body["param"] == "messages"


def test_prompt_longer_than_context():
    service, thread = _serve(ScriptedEngine(max_context=64))
    with thread as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 100}])
        assert e.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="m", prompt="y" * 100)


def test_engine_failure_is_a_generic_500(server, client):
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "crash please"}])
    assert e.value.status_code == 500
    assert "secret" not in json.dumps(e.value.body) and "Traceback" not in json.dumps(e.value.body)
    assert e.value.body["type"] == "server_error"
    # the server keeps serving
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices


def test_a_grammar_that_dead_ends_is_a_400_not_a_500(server, client):
    """A format that passed the checks but that llguidance cannot continue mid-generation (none is
    known: server.tool_grammars refuses the unsatisfiable schemas it can see) is the request's: a 400."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a dead end please"}])
    assert "cannot be followed" in e.value.body["message"] and e.value.body["code"] == "invalid_value"
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices


def test_api_key(monkeypatch):
    monkeypatch.setenv("SAILFISH_API_KEY", "sekret")
    settings = Settings.from_args([])
    assert settings.api_key == "sekret"
    service = Service(ScriptedEngine(), Settings(api_key="sekret", trace_log=False))
    with ServerThread(create_app(service)) as url:
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert good.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200


def test_health_and_metrics(server, client):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(server[2] + "/health").json()["status"] == "ok"
    text = httpx.get(server[2] + "/metrics").text
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "sailfish_generation_tokens_total",
                 "sailfish_request_latency_seconds_bucket", "sailfish_time_to_first_token_seconds_count"):
        assert name in text
    assert 'sailfish_requests_total{endpoint="chat",outcome="ok"}' in text


def test_concurrent_requests_are_fifo_and_identical_to_solo():
    engine = ScriptedEngine(delay=0.002)
    service, thread = _serve(engine)
    prompts = [f"request {i}: hi" for i in range(6)]
    with thread as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        solo = [c.chat.completions.create(model="m", messages=[{"role": "user", "content": p}]).choices[0].message.content
                for p in prompts]
        engine.prompts.clear()
        results: dict[int, str] = {}

        def send(i):
            r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": prompts[i]}])
            results[i] = r.choices[0].message.content

        threads = []
        for i in range(len(prompts)):
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()
            time.sleep(0.05)  # a known arrival order
        for t in threads:
            t.join()
    assert [results[i] for i in range(len(prompts))] == solo
    assert [p.split("request ")[1][:1] for p in engine.prompts] == [str(i) for i in range(len(prompts))]


def test_disconnect_stops_generation():
    engine = ScriptedEngine(script=lambda p: "word " * 2000, delay=0.005)
    service, thread = _serve(engine)
    with thread as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], stream=True)
        for i, _ in enumerate(stream):
            if i == 5:
                break
        stream.close()
        # a non-streaming client that gives up
        with pytest.raises(openai.APITimeoutError):
            c.with_options(timeout=0.5).chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
        deadline = time.monotonic() + 10
        while len(engine.log) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(engine.log) == 2
    for _, emitted, stopped_early in engine.log:
        assert stopped_early and emitted < 2000 // 2


def test_trace_log_capture(tmp_path):
    trace_dir = tmp_path / "traces"
    service = Service(ScriptedEngine(), Settings(trace_dir=trace_dir))
    with ServerThread(create_app(service)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        c.chat.completions.create(**_weather())
        list(c.chat.completions.create(**_weather(stream=True)))
    files = list(trace_dir.glob("*.jsonl"))
    assert len(files) == 1
    assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(trace_dir).st_mode) == 0o700
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert line["tools"][0]["function"]["name"] == "get_weather"
        user, assistant = line["messages"]
        assert user["content"] == "What is the weather in Paris?"
        assert assistant["content"] == "Let me check. "
        assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    # the index builder reads it back
    from index.traces import ReadReport, iter_conversations

    report = ReadReport()
    convs = list(iter_conversations([trace_dir], report))
    assert len(convs) == 2 and not report.skipped


def test_trace_log_rotation_and_failure(tmp_path):
    from server.trace_log import TraceLog

    log = TraceLog(tmp_path / "t", max_bytes=300)
    for _ in range(5):
        assert log.append([{"role": "user", "content": "x" * 100}], [])
    assert len(list((tmp_path / "t").glob("*.jsonl"))) >= 3
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    service = Service(ScriptedEngine(), Settings(trace_dir=blocker / "traces"))
    with ServerThread(create_app(service)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices
    assert service.trace_log.failed == 1


def test_trace_log_never_keeps_a_broken_line(tmp_path):
    """A write cut short (a file-size limit here, a full disk in life) is cut back off: the log
    holds whole lines only, the next record starts on a line of its own, and the failure is counted."""
    import resource

    from server.trace_log import TraceLog

    log = TraceLog(tmp_path / "t")
    big = [{"role": "user", "content": "y" * 6000}]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, hard))  # Python ignores SIGXFSZ: writes fail
    try:
        assert log.append(big, []) is True
        assert log.append(big, []) is False  # 4 kB fit under the limit: written, then cut back off
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert log.append([{"role": "user", "content": "after"}], []) is True and log.failed == 1
    lines = log.path.read_text().splitlines()
    assert [json.loads(line)["messages"][0]["content"][:5] for line in lines] == ["yyyyy", "after"]


def test_a_taken_port_or_a_foreign_host_is_said_before_the_model_loads(monkeypatch, caplog, tmp_path):
    """`python -m server` binds its socket first: a port in use or a host that is not this machine's
    ends it with status 2 and the reason, before any model is loaded, as does a --trace-dir that
    cannot be written; a port past 65535 is a usage error; port 0 gets a free port, which the socket
    names."""
    import signal
    import socket

    import server.serving
    from server.__main__ import bound_socket, main

    monkeypatch.setattr(server.serving, "load_engine", lambda settings: pytest.fail("the model was loaded"))
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)  # main() would install its handlers here
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        assert main(["--port", str(taken.getsockname()[1]), "--no-trace-log"]) == 2
        assert "cannot serve on 127.0.0.1 port" in caplog.text and "in use" in caplog.text
        assert main(["--host", "no-such-host.invalid", "--no-trace-log"]) == 2
        a_file = tmp_path / "a_file"
        a_file.write_text("x")
        assert main(["--port", "0", "--trace-dir", str(a_file)]) == 2
        assert "cannot keep the trace log in --trace-dir" in caplog.text
    finally:
        taken.close()
    with pytest.raises(SystemExit) as usage:
        Settings.from_args(["--port", "70000"])
    assert usage.value.code == 2
    free = bound_socket("127.0.0.1", 0)
    assert free.getsockname()[1] > 0
    free.close()


def test_stopping_the_server_stops_generations_in_flight_with_a_503():
    """What Ctrl-C / SIGTERM does (server/__main__.py): every running and waiting request is
    cancelled at its next step, each client told so in its API's error shape (a streamed one as its
    last event), instead of the shutdown waiting for whole generations."""
    engine = ScriptedEngine(delay=0.05, script=lambda prompt: "word " * 400)
    service, thread = _serve(engine)
    with thread as url:
        got: dict = {}

        def streamed():
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
                    "model": "m", "messages": HI, "stream": True, "max_tokens": 500}) as r:
                got["stream"] = [line for line in r.iter_lines() if line.startswith("data:")]

        def whole():
            got["whole"] = httpx.post(url + "/v1/messages", timeout=30, json={
                "model": "m", "max_tokens": 500, "messages": HI})

        threads = [threading.Thread(target=streamed), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        while service.scheduler.running + service.scheduler.waiting < 2:
            time.sleep(0.01)
        time.sleep(0.2)
        started = time.perf_counter()
        service.scheduler.cancel_all()
        for t in threads:
            t.join(timeout=30)
        assert time.perf_counter() - started < 5  # not the 400 tokens' 20 s
        last = json.loads(got["stream"][-1][len("data:"):])
        assert last["error"]["code"] == "server_shutting_down" and last["error"]["type"] == "server_error"
        assert got["whole"].status_code == 503 and got["whole"].json()["type"] == "error"
        late = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": HI})  # after the stop
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"


def test_settings_cli():
    s = Settings.from_args(["--port", "9999", "--no-draft", "--max-draft", "5", "--confidence-cutoff", "0.5",
                            "--no-trace-log", "--index", "somewhere", "--no-use-context"])
    assert (s.port, s.draft, s.trace_log, str(s.index)) == (9999, False, False, "somewhere")
    assert s.drafter.max_draft == 5 and s.drafter.confidence_cutoff == 0.5 and s.drafter.use_context is False
    d = Settings.from_args([])
    assert (d.host, d.port, d.draft, d.trace_log) == ("127.0.0.1", 22343, True, True)


@pytest.mark.parametrize("flag,value", [("--gpu-memory-mb", "0"), ("--fast-max-context", "0"),
                                        ("--prefix-cache-mb", "-1"), ("--parallel", "0")])
def test_settings_cli_refuses_values_below_a_minimum(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        Settings.from_args([flag, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and f"{value} is below the minimum" in err
    assert Settings.from_args([flag, "8"]).engine is not None  # at or above it: accepted


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("raw,status,code", [
    (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "too_deep"),          # past the C decoder's limit
    (b'{"messages": ' + b"[" * 70 + b"]" * 70 + b"}", 400, "too_deep"),              # past ours (64)
    (json.dumps({"messages": HI, "seed": 2**70}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": HI, "temperature": 10**400}).encode(), 400, "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400, "invalid_value"),
    (json.dumps({"messages": HI, "max_tokens": 10**30}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": HI + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[" * 3000 + "]" * 3000}}]}]}).encode(), 400, "too_deep"),
])
def test_hostile_bodies_get_a_4xx(server, raw, status, code):
    r = httpx.post(server[2] + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "LONE"}]}),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "description": "LONE", "parameters": {"type": "object"}}}]}),
    ("/v1/completions", {"prompt": "LONE", "max_tokens": 2}),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "LONE"}]}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "LONE"}]}),
    ("/v1/responses", {"model": "m", "input": "LONE"}),
])
def test_a_lone_surrogate_is_a_400_in_each_apis_shape(server, path, body):
    """JSON may escape a surrogate half alone ("\\ud800"), which no text encoding carries: a 400
    naming where it is, in the API's own error shape; a whole pair (an emoji) is text as usual."""
    raw = json.dumps(body).replace("LONE", "a \\ud800 b").encode()
    r = httpx.post(server[2] + path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "lone UTF-16 surrogate" in error["message"]
    assert error["type"] == "invalid_request_error"
    if path.startswith("/v1/messages"):  # Anthropic's shape: {"type": "error", "error": {...}}
        assert r.json()["type"] == "error"
    pair = json.dumps(body).replace("LONE", "a \\ud83d\\ude00 b").encode()
    assert httpx.post(server[2] + path, content=pair, headers={"content-type": "application/json"}).status_code == 200


def test_oversized_body_is_a_413_and_deep_tool_results_render_as_text(server):
    from server.protocol import MAX_BODY_BYTES

    r = httpx.post(server[2] + "/v1/chat/completions", content=b"x" * (MAX_BODY_BYTES + 1),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    deep = "{\"a\":" * 500 + "1" + "}" * 500   # a tool's output is text: kept as a string
    r = httpx.post(server[2] + "/v1/chat/completions", json={"model": "m", "messages": HI + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": deep}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions"])
def test_a_client_gone_mid_upload_is_not_a_server_error(server, path):
    """A body shorter than its Content-Length, then the socket closed: the client's disconnect, not an
    unhandled exception (it was counted in sailfish_internal_errors_total and logged with a trace)."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(server[2])
    errors = lambda: re.search(r"^sailfish_internal_errors_total (\d+)", httpx.get(server[2] + "/metrics").text, re.M)
    before = int(errors().group(1))
    body = json.dumps({"model": "m", "messages": HI}).encode()
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body) + 100}\r\n\r\n".encode() + body)
    time.sleep(0.3)   # the server sees the close
    assert int(errors().group(1)) == before
    assert httpx.post(server[2] + "/v1/chat/completions", json={"model": "m", "messages": HI}).status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "SLOW"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "SLOW"}]}),
    ("/v1/responses", {"model": "m", "input": "SLOW"}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "SLOW"}]})])
def test_preparing_a_prompt_does_not_hold_the_event_loop(path, body):
    """Rendering and tokenizing a prompt (and building the grammar compiler, on the first constrained
    request) run off the event loop: while one request's preparation takes 1.5 s, /health and other
    streams answer (on the loop a 2M-character prompt stalled every stream for 1.4 s, the first
    compile for 3 s)."""
    engine = ScriptedEngine()
    service, thread = _serve(engine)
    prepare = service._chat_prompt if path.endswith("count_tokens") else service.prepare_chat

    def slow(req):
        if "SLOW" in json.dumps(req.messages):
            time.sleep(1.5)
        return prepare(req)
    setattr(service, "_chat_prompt" if path.endswith("count_tokens") else "prepare_chat", slow)
    with thread as url:
        answer: list = []
        t = threading.Thread(target=lambda: answer.append(httpx.post(url + path, json=body, timeout=30)))
        t.start()
        time.sleep(0.3)   # its preparation has begun
        t0 = time.perf_counter()
        health = httpx.get(url + "/health", timeout=30)
        waited = time.perf_counter() - t0
        t.join()
    assert health.status_code == 200 and answer[0].status_code == 200, answer[0].text
    assert waited < 0.8, f"/health waited {waited:.2f} s behind a prompt's preparation"


def test_tiny_temperature_is_greedy_and_token_ids_are_checked():
    from server.protocol import APIError, ChatCompletionRequest, CompletionRequest

    assert ChatCompletionRequest.parse({"messages": HI, "temperature": 1e-320}).sampling.temperature == 0.0
    with pytest.raises(APIError):
        CompletionRequest.parse({"prompt": [5, -1]})
    engine = ScriptedEngine()
    engine.vocab_size = 300
    service, thread = _serve(engine)
    with thread as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": [2, 300], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert httpx.post(url + "/v1/completions", json={"prompt": [2, 299], "max_tokens": 2}).status_code == 200


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing():
    from server.serving import MAX_CHARS_PER_TOKEN

    engine = ScriptedEngine(max_context=64)
    seen = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, **kw: seen.append(len(text)) or encode(text, **kw)
    service, thread = _serve(engine)
    with thread as url:
        r = httpx.post(url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "x" * (MAX_CHARS_PER_TOKEN * 64 + 1)}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.post(url + "/v1/completions", json={"prompt": "y" * (MAX_CHARS_PER_TOKEN * 64 + 1)})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert not any(n > MAX_CHARS_PER_TOKEN * 64 for n in seen)


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5),
                                         ("top_k", -2), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.1),
                                         ("presence_penalty", 2.1), ("frequency_penalty", -3),
                                         ("repetition_penalty", 0), ("repetition_penalty", 11), ("seed", 2**64),
                                         ("logit_bias", {"5": 10}), ("top_logprobs", 2), ("min_tokens", 3)])
def test_each_bad_sampling_value_gets_a_400_naming_it(field, value):
    from server.protocol import APIError, ChatCompletionRequest, CompletionRequest

    for parse, body in ((ChatCompletionRequest.parse, {"messages": HI}), (CompletionRequest.parse, {"prompt": "x"})):
        with pytest.raises(APIError) as e:
            parse({**body, field: value})
        assert e.value.status == 400 and e.value.body()["error"]["param"] == field


def test_sampling_fields_and_model_defaults_are_parsed():
    from server.protocol import ChatCompletionRequest

    s = ChatCompletionRequest.parse({"messages": HI, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                                     "presence_penalty": 0.5, "frequency_penalty": -0.5,
                                     "repetition_penalty": 1.1, "seed": -3}).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty,
            s.repetition_penalty, s.seed) == (0.7, 0.8, 20, 0.05, 0.5, -0.5, 1.1, -3)
    assert ChatCompletionRequest.parse({"messages": HI, "top_k": -1}).sampling.top_k == 0  # vLLM's "off"
    defaults = {"temperature": 1.0, "top_k": 64, "top_p": 0.95}
    s = ChatCompletionRequest.parse({"messages": HI, "top_p": 0.5}, defaults).sampling
    assert (s.temperature, s.top_k, s.top_p) == (1.0, 64, 0.5)  # the request's own field wins
    assert ChatCompletionRequest.parse({"messages": HI}).sampling.greedy


def test_generation_config_defaults_follow_the_checkpoint():
    from transformers import GenerationConfig

    from server.sampling import sampling_defaults

    assert sampling_defaults(None) == {}
    assert sampling_defaults(GenerationConfig(eos_token_id=1)) == {}           # the bundled base model: greedy
    assert sampling_defaults(GenerationConfig(do_sample=True, top_k=64, top_p=0.95)) == {
        "temperature": 1.0, "top_k": 64, "top_p": 0.95}                          # Gemma's published defaults


WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
SAME_ANSWER_CASES = [
    dict(messages=HI), dict(messages=HI, max_tokens=2), dict(messages=HI, stop=["!"]),
    dict(messages=WEATHER, tools=[WEATHER_TOOL]), dict(messages=WEATHER, tools=[WEATHER_TOOL], tool_choice="none"),
    dict(messages=WEATHER, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    dict(messages=HI, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required"),
    dict(messages=HI, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", max_tokens=3),  # forced call cut off
    dict(messages=[{"role": "user", "content": "weather and time, both please"}], tools=[WEATHER_TOOL, TIME_TOOL]),
    dict(messages=[{"role": "user", "content": "weather and time, both please"}], tools=[WEATHER_TOOL, TIME_TOOL],
         max_tokens=20),  # the second call cut off
]


@pytest.mark.parametrize("req", SAME_ANSWER_CASES)
def test_streamed_and_whole_answers_are_the_same(client, req):
    whole = client.chat.completions.create(model="m", **req)
    chunks = list(client.chat.completions.create(model="m", **req, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    content = "".join(c.delta.content or "" for c in choices)
    streamed: dict[int, list] = {}
    for d in (d for c in choices for d in c.delta.tool_calls or []):
        call = streamed.setdefault(d.index, [d.id, "", ""])
        call[1] += d.function.name or ""
        call[2] += d.function.arguments or ""
    message = whole.choices[0].message
    whole_calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert [(name, args) for _, name, args in (streamed[i] for i in sorted(streamed))] == whole_calls
    assert all(call_id.startswith("call_") for call_id, _, _ in streamed.values())
    assert message.content == (content if content.strip() or not whole_calls else None)
    assert [c.finish_reason for c in choices if c.finish_reason] == [whole.choices[0].finish_reason]
    assert _token_counts(chunks[-1].usage) == _token_counts(whole.usage)


def _token_counts(usage) -> tuple:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("req", [dict(prompt="Say hello", max_tokens=4), dict(prompt="Say hello", max_tokens=50),
                                 dict(prompt="Say hello", stop="!"), dict(prompt=[72, 105], max_tokens=5)])
def test_streamed_and_whole_completions_are_the_same(client, req):
    whole = client.completions.create(model="m", **req)
    chunks = list(client.completions.create(model="m", **req, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == whole.choices[0].text
    assert [c.finish_reason for c in choices if c.finish_reason] == [whole.choices[0].finish_reason]
    assert _token_counts(chunks[-1].usage) == _token_counts(whole.usage)


class ReloadableEngine(ScriptedEngine):
    def set_drafter(self, drafter):
        self._drafter = drafter


def test_reload_status_maps_to_http(tmp_path):
    import numpy as np

    from common.tokenizer import tokenizer_fingerprint
    from ngram.index_file import BuildParams, write_index
    from server.reload import ReloadStatus

    engine, index_dir = ReloadableEngine(), tmp_path / "index"
    write_turns = lambda fingerprint: write_index(index_dir, [np.arange(1, 41, dtype=np.uint32)] * 4, fingerprint,
                                                  BuildParams())
    service, thread = _serve(engine, index=index_dir)
    off, off_thread = _serve(ReloadableEngine(), index=index_dir, draft=False)
    with thread as url, off_thread as off_url:
        reload = lambda base: httpx.post(base + "/admin/reload-index")
        r = reload(url)  # no index yet
        assert r.status_code == 409 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "index_refused" and r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["message"].startswith("refused: no n-gram index")
        assert httpx.get(url + "/health").json()["index"] is None
        write_turns(tokenizer_fingerprint(engine.tokenizer))
        r = reload(url)
        assert r.status_code == 200 and r.json()["reloaded"] is True and set(r.json()) == {"reloaded", "message"}
        assert engine._drafter is not None and httpx.get(url + "/health").json()["drafting"] == r.json()["message"]
        assert httpx.get(url + "/health").json()["index"] == str(engine._drafter.index.path)
        r = reload(url)
        assert r.status_code == 200 and r.json()["reloaded"] is False and r.json()["message"].startswith("unchanged")
        in_service = engine._drafter
        write_turns("another-tokenizer")
        r = reload(url)
        assert r.status_code == 409 and "different tokenizer" in r.json()["error"]["message"]
        assert engine._drafter is in_service
        r = reload(off_url)
        assert r.status_code == 200 and r.json() == {"reloaded": False, "message": off.reload_index().message}
    assert off.reload_index().status is ReloadStatus.UNCHANGED
    assert service.reload_index().status is ReloadStatus.REFUSED


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("messages,status", [
    (HI + [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "r"}], 200),
    (HI + [{"role": "assistant", "tool_calls": [CALL]}, {"role": "user", "content": "never mind"}], 200),  # unanswered
    (HI + [{"role": "tool", "tool_call_id": "call_1", "content": "r"}], 400),                      # no call before it
    (HI + [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "zzz", "content": "r"}], 400),
    (HI + [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "r"},
           {"role": "tool", "tool_call_id": "call_1", "content": "again"}], 400),                  # answered twice
    (HI + [{"role": "assistant", "tool_calls": [CALL]}, {"role": "user", "content": "x"},
           {"role": "tool", "tool_call_id": "call_1", "content": "late"}], 400),                   # not right after
])
def test_a_tool_result_must_answer_a_call_of_the_turn_before_it(server, messages, status):
    r = httpx.post(server[2] + "/v1/chat/completions", json={"model": "m", "messages": messages})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["code"] == "invalid_tool_result" and r.json()["error"]["param"] == "messages"


def test_message_keys_that_cannot_be_honoured_are_refused_by_name():
    """A chat message's keys: what a client keeps beside a response's text (the openai SDK's `parsed`,
    annotations, LiteLLM's provider fields), nulls of any key, a `prefix` that is off and proxies'
    cache_control are accepted; a refusal's text is the assistant's text; earlier reasoning under the
    names clients give it is the message's reasoning; a key no message of that role has, or one asking
    for what Sailfish cannot do (continue a message, a made function_call or audio), is a 400 naming it."""
    from server.protocol import APIError, ChatCompletionRequest

    echoed = {"role": "assistant", "content": "ok", "refusal": None, "annotations": [{"type": "url_citation"}],
              "audio": None, "function_call": None, "parsed": {"city": "Paris"}, "provider_specific_fields": {},
              "prefix": False, "tool_call_id": None, "cache_control": {"type": "ephemeral"}}
    user = {"role": "user", "content": "hi", "tool_calls": [], "tool_call_id": None, "reasoning_content": ""}
    parsed = ChatCompletionRequest.parse({"messages": [user, echoed, *HI]}).messages
    assert parsed[:2] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    refused = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    assert ChatCompletionRequest.parse({"messages": [*HI, refused, *HI]}).messages[1]["content"] == refused["refusal"]
    for key, value in (("reasoning_content", "r"), ("reasoning", "r"), ("thinking", "r"),
                       ("reasoning_details", [{"type": "reasoning.text", "text": "r"}, {"type": "reasoning.encrypted"}]),
                       ("thinking_blocks", [{"type": "thinking", "thinking": "r", "signature": "s"}])):
        said = {"role": "assistant", "content": "ok", key: value}
        assert ChatCompletionRequest.parse({"messages": [*HI, said, *HI]}).messages[1]["reasoning_content"] == "r", key
    both = {"role": "assistant", "content": "ok", "reasoning": "AB",   # OpenRouter: one text under two names
            "reasoning_details": [{"type": "reasoning.text", "text": "A"}, {"type": "reasoning.text", "text": "B"}]}
    assert ChatCompletionRequest.parse({"messages": [*HI, both, *HI]}).messages[1]["reasoning_content"] == "AB"
    del both["reasoning"]
    assert ChatCompletionRequest.parse({"messages": [*HI, both, *HI]}).messages[1]["reasoning_content"] == "A\n\nB"
    for bad, param in (({"role": "assistant", "content": "par", "prefix": True}, "messages[1].prefix"),
                       ({"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}},
                        "messages[1].function_call"),
                       ({"role": "assistant", "content": "", "audio": {"id": "a1"}}, "messages[1].audio"),
                       ({"role": "assistant", "content": "", "refusal": 5}, "messages[1].refusal"),
                       ({"role": "assistant", "content": "", "reasoning_details": "r"}, "messages[1].reasoning_details"),
                       ({"role": "assistant", "content": "", "thinking": ["r"]}, "messages[1].thinking"),
                       ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[1].tool_call_id"),
                       ({"role": "user", "content": "x", "parsed": {"a": 1}}, "messages[1].parsed"),
                       ({"role": "user", "content": "x", "weight": 1}, "messages[1].weight"),
                       ({"role": "user", "content": "x", "name": 5}, "messages[1].name")):
        with pytest.raises(APIError) as e:
            ChatCompletionRequest.parse({"messages": [*HI, bad]})
        assert e.value.status == 400 and e.value.body()["error"]["param"] == param, bad
