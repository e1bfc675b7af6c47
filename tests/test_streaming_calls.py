"""Tool calls streamed as they are generated, on all three APIs, plus the smaller agent-API fixes
(CORS, max_tokens / max_completion_tokens, the context length in /v1/models).

The server runs the SCRIPTED STAND-IN ENGINE of test_server_protocol.py, which emits its script three
characters per "token" (token-sized pieces), so a long call reaches the parser in dozens of pieces.
The invariant checked everywhere: a call's streamed argument fragments concatenate exactly to the
`arguments` of the whole (non-streamed) answer, which for a well-formed call is also what
`parse_generated` makes of the same text; a call cut off by max_tokens is the same unfinished call in
the stream and in the whole answer.
"""
from __future__ import annotations

import json
import random

import anthropic
import httpx
import openai
import pytest

from common.chat_format import (ArgumentsDelta, CallEnded, CallStarted, ToolCallStreamer, format_value,
                                parse_generated)
from server.anthropic_api import partial_json_object
from tests.test_server_protocol import ScriptedEngine, _serve, default_script, serving

WRITE_TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "options": {"type": "object"}}}}}
# nested objects and arrays, every bare value kind, and strings needing JSON escapes (quotes, backslash,
# newline, tab, a control character, non-ASCII, and characters that are syntax outside a string)
LONG_CALL_BODY = ('path:<|"|>src/a "b".txt<|"|>,content:<|"|>line 1\nline\t2 \\ "quoted" é 😀 \x01 <tag> {x:[1]},'
                  '<|"|>,options:{mode:<|"|>w<|"|>,flags:[1,2.5,-3e2,true,false,null,<|"|>x,y<|"|>,[],{}],'
                  'nested:{deep:[{k:bare word},[[<|"|><|"|>]]]}},count:42')
LONG_CALL = "<|tool_call>call:write_file{" + LONG_CALL_BODY + "}<tool_call|>"
LONG_ANSWER = "I will write it. " + LONG_CALL
EXPECTED_ARGUMENTS = parse_generated(LONG_ANSWER).tool_calls[0]["arguments"]
WRITE = [{"role": "user", "content": "please write the file"}]


THOUGHT = "The user wants a file.\nI will call write_file."
THINKING_ANSWERS = {  # thinking, then the streamed call; or thinking the model wrote inside the call's body
    "before": f"<|channel>thought\n{THOUGHT}\n<channel|>" + LONG_ANSWER,
    "inside": LONG_ANSWER.replace(",count:42", f"<|channel>thought\n{THOUGHT}\n<channel|>,count:42"),
}


def script(prompt: str) -> str:
    last_user = prompt.rsplit("<|turn>user\n", 1)[-1]
    for where, answer in THINKING_ANSWERS.items():
        if f"think {where}" in last_user:
            return answer + "<|tool_response>"
    if "write the file" in last_user:
        return LONG_ANSWER + "<|tool_response>"
    return default_script(prompt)


@pytest.fixture(scope="module")
def server():
    yield from serving(ScriptedEngine(script))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[2] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[2], api_key="unused", max_retries=0)


def _tokens_until(text: str, marker: str) -> int:
    """The scripted tokens (three characters each) needed to emit `text` up to and including `marker`."""
    return -(-(text.index(marker) + len(marker)) // 3)


def test_expected_arguments_are_the_json_of_the_value():
    assert json.loads(EXPECTED_ARGUMENTS) == {
        "path": 'src/a "b".txt', "content": 'line 1\nline\t2 \\ "quoted" é 😀 \x01 <tag> {x:[1]},',
        "options": {"mode": "w", "flags": [1, 2.5, -300.0, True, False, None, "x,y", [], {}],
                    "nested": {"deep": [{"k": "bare word"}, [[""]]]}}, "count": 42}


# ---------------------------------------------------------------- the parser


def _stream(text: str, pieces: list[str], forced: str = "") -> list:
    streamer = ToolCallStreamer(forced)
    events = [event for piece in pieces for event in streamer.feed(piece)]
    return events + streamer.finish()


def _folded(events: list) -> tuple[str, list[dict]]:
    """(content, calls) of a stream, each call's arguments checked to be its fragments' concatenation."""
    content, calls, fragments = "", [], None
    for event in events:
        if isinstance(event, str):
            content += event
        elif isinstance(event, CallStarted):
            fragments = []
        elif isinstance(event, ArgumentsDelta):
            assert event.text
            fragments.append(event.text)
        elif isinstance(event, CallEnded):
            assert event.arguments == "".join(fragments)
            calls.append({"name": event.name, "arguments": event.arguments})
    return content, calls


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice([0, -3, 1.5, 1e20, 12345678901234567890, True, False, None])
    if kind <= 3:
        return "".join(rng.choice('ab "\\\n\t/é😀<>{}[],:\u2028') for _ in range(rng.randrange(7)))
    if kind <= 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"{rng.choice(['a', 'b c', 'ü'])}{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def test_streamed_calls_equal_the_whole_parse_for_any_split():
    rng = random.Random(7)
    for _ in range(400):
        value = {f"k{i}": _random_value(rng) for i in range(rng.randrange(4))}
        text = f"pre <|tool_call>call:f{format_value(value)}<tool_call|> mid <|tool_call>call:g{{}}<tool_call|> <|to"
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 10))))
        for pieces in ([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], list(text)):
            whole = parse_generated(text)
            assert _folded(_stream(text, pieces)) == (whole.content, whole.tool_calls)


def test_arguments_stream_while_the_call_is_open():
    streamer = ToolCallStreamer()
    assert streamer.feed("Hi <|tool_c") == ["Hi "]  # only a possible marker prefix is held back
    assert streamer.feed("all>call:write_fi") == []
    assert streamer.feed('le{path:<|"|>a\\b') == [CallStarted("write_file"), ArgumentsDelta('{"path": "a\\\\b')]
    assert streamer.feed('<|"') == []  # could close the string: held
    assert streamer.feed('|>,n:1') == [ArgumentsDelta('"')]  # a bare value waits for its end
    assert streamer.feed("2}") == [ArgumentsDelta(', "n": 12}'), CallEnded("write_file", '{"path": "a\\\\b", "n": 12}', True)]
    assert streamer.feed("<tool_call|>bye") == ["bye"]


def test_a_forced_call_starts_at_once():
    streamer = ToolCallStreamer("<|tool_call>call:get_weather{")
    assert streamer.feed("city") == [CallStarted("get_weather"), ArgumentsDelta("{")]
    assert streamer.finish() == [CallEnded("get_weather", "{", False)]


@pytest.mark.parametrize("text, want", [
    # cut off: the call stays a call, its arguments the unfinished JSON (never closed into a finished call)
    ('<|tool_call>call:f{a:<|"|>rm -rf /ho', [CallStarted("f"), ArgumentsDelta('{"a": "rm -rf /ho'),
                                              CallEnded("f", '{"a": "rm -rf /ho', False)]),
    ("<|tool_call>call:f{a:12", [CallStarted("f"), ArgumentsDelta("{"), CallEnded("f", "{", False)]),
    # the body breaks the syntax: the call ends there and the rest of its text is dropped
    ('<|tool_call>call:f{a:<|"|>x<|"|>,<tool_call|>after', [
        CallStarted("f"), ArgumentsDelta('{"a": "x"'), CallEnded("f", '{"a": "x"', False), "after"]),
    ("<|tool_call>call:f{a:1 b}<tool_call|>!", [
        CallStarted("f"), ArgumentsDelta('{"a": "1 b"}'), CallEnded("f", '{"a": "1 b"}', True), "!"]),
    # not a call head: content through its closing marker, as parse_generated has it
    ("x<|tool_call>nonsense<tool_call|>y", ["x<|tool_call>nonsense<tool_call|>y"]),
    # cut off before the name is complete: the markup is dropped
    ("x<|tool_call>call:sea", ["x"]),
])
def test_cut_off_broken_and_non_calls(text, want):
    for pieces in ([text], list(text)):
        assert _joined(_stream(text, pieces)) == want


def _joined(events: list) -> list:
    out = []
    for event in events:
        if isinstance(event, ArgumentsDelta) and out and isinstance(out[-1], ArgumentsDelta):
            out[-1] = ArgumentsDelta(out[-1].text + event.text)
        elif isinstance(event, str) and out and isinstance(out[-1], str):
            out[-1] += event
        else:
            out.append(event)
    return out


def test_partial_json_object_reads_a_cut_off_call_as_anthropics_sdk_does():
    jiter = pytest.importorskip("jiter")
    streamer = ToolCallStreamer()
    fragments = [e.text for piece in [LONG_CALL[i:i + 3] for i in range(0, len(LONG_CALL), 3)]
                 for e in streamer.feed(piece) if isinstance(e, ArgumentsDelta)]
    assert "".join(fragments) == EXPECTED_ARGUMENTS and len(fragments) > 20
    for n in range(1, len(fragments) + 1):
        prefix = "".join(fragments[:n])
        assert partial_json_object(prefix) == jiter.from_json(prefix.encode(), partial_mode=True), prefix


# ---------------------------------------------------------------- the three APIs


def _chat_stream(client, **req):
    chunks = list(client.chat.completions.create(model="m", messages=WRITE, tools=[WRITE_TOOL], stream=True, **req))
    return [c.choices[0] for c in chunks if c.choices]


@pytest.mark.parametrize("max_tokens", [None, _tokens_until(LONG_ANSWER, "line\t2")])
def test_chat_arguments_stream_in_fragments_that_make_the_whole_arguments(client, max_tokens):
    limit = {"max_tokens": max_tokens} if max_tokens else {}
    whole = client.chat.completions.create(model="m", messages=WRITE, tools=[WRITE_TOOL], **limit).choices[0]
    choices = _chat_stream(client, **limit)
    kinds = ["content" if c.delta.content else "call" if c.delta.tool_calls else None for c in choices]
    first_call = kinds.index("call")
    assert "".join(c.delta.content or "" for c in choices[:first_call]) == "I will write it. "  # not held back
    start, *fragments = [d for c in choices for d in c.delta.tool_calls or []]
    assert (start.index, start.function.name, start.function.arguments) == (0, "write_file", "")
    assert start.id.startswith("call_") and all(d.id is None and d.index == 0 for d in fragments)
    assert len(fragments) > 10  # arrives as it is generated, not in one piece at the end
    streamed = "".join(d.function.arguments for d in fragments)
    (call,) = whole.message.tool_calls
    assert streamed == call.function.arguments
    if max_tokens is None:
        assert streamed == EXPECTED_ARGUMENTS and whole.finish_reason == choices[-1].finish_reason == "tool_calls"
    else:  # cut off: the same unfinished call in both, and finish_reason length
        assert EXPECTED_ARGUMENTS.startswith(streamed) and "line\\t2" in streamed
        assert whole.finish_reason == choices[-1].finish_reason == "length"
        with pytest.raises(ValueError):
            json.loads(streamed)


def test_a_stop_string_inside_a_call_ends_it_unfinished_as_stop_not_as_a_call(client, claude):
    """A stop sequence that matches inside an unenforced call's arguments (tool_choice auto) cuts the
    call: the same unfinished call in the stream and the whole answer, and the finish says the stop
    sequence ended it ("stop", or Anthropic's "stop_sequence" naming it), never a finished call's
    "tool_calls" / "tool_use". (A call the request enforces is not cut: tests/test_structured_output.py.)"""
    stop = "line\t2"
    whole = client.chat.completions.create(model="m", messages=WRITE, tools=[WRITE_TOOL], stop=[stop]).choices[0]
    choices = _chat_stream(client, stop=[stop])
    (call,) = whole.message.tool_calls
    streamed = "".join(d.function.arguments for c in choices for d in c.delta.tool_calls or [])
    assert streamed == call.function.arguments and EXPECTED_ARGUMENTS.startswith(streamed)
    assert "line 1" in streamed and "line\\t2" not in streamed
    assert whole.finish_reason == choices[-1].finish_reason == "stop"
    tool = {"name": "write_file", "input_schema": WRITE_TOOL["function"]["parameters"]}
    req = dict(model="m", max_tokens=200, messages=WRITE, tools=[tool], stop_sequences=[stop])
    message = claude.messages.create(**req)
    with claude.messages.stream(**req) as stream:
        streamed_message = stream.get_final_message()
    for m in (message, streamed_message):
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
        assert [b.type for b in m.content] == ["text", "tool_use"]
    # a stop string after a finished call leaves it a call: "tool_calls"
    after = client.chat.completions.create(model="m", messages=WRITE, tools=[WRITE_TOOL], stop=["<|tool_response>"])
    assert after.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("max_tokens", [200, _tokens_until(LONG_ANSWER, "x,y")])
def test_anthropic_input_json_streams_in_fragments(client, claude, max_tokens):
    tool = {"name": "write_file", "input_schema": WRITE_TOOL["function"]["parameters"]}
    req = dict(model="m", max_tokens=max_tokens, messages=WRITE, tools=[tool])
    events = list(claude.messages.create(**req, stream=True))
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta"]
    assert len(partial) > 10
    chat = client.chat.completions.create(model="m", messages=WRITE, tools=[WRITE_TOOL], max_tokens=max_tokens)
    assert "".join(partial) == chat.choices[0].message.tool_calls[0].function.arguments
    whole = claude.messages.create(**req)
    with claude.messages.stream(**req) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in whole.content] == ["text", "tool_use"]
    assert whole.content[1].input == streamed.content[1].input == partial_json_object("".join(partial))
    assert whole.stop_reason == streamed.stop_reason == ("tool_use" if max_tokens == 200 else "max_tokens")
    if max_tokens == 200:
        assert whole.content[1].input == json.loads(EXPECTED_ARGUMENTS)


@pytest.mark.parametrize("max_output_tokens", [None, _tokens_until(LONG_ANSWER, "mode:")])
def test_responses_arguments_stream_in_fragments(client, max_output_tokens):
    tool = {"type": "function", "name": "write_file", "parameters": WRITE_TOOL["function"]["parameters"]}
    req = dict(model="m", input="please write the file", tools=[tool], max_output_tokens=max_output_tokens)
    events = list(client.responses.create(**req, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 10 and "".join(deltas) == done.arguments
    whole = client.responses.create(**req)
    call = whole.output[1]
    assert call.type == "function_call" and call.arguments == done.arguments
    assert [item.model_dump(exclude={"id", "call_id"}) for item in events[-1].response.output] == [
        item.model_dump(exclude={"id", "call_id"}) for item in whole.output]
    if max_output_tokens is None:
        assert call.arguments == EXPECTED_ARGUMENTS and call.status == "completed" and whole.status == "completed"
    else:
        assert EXPECTED_ARGUMENTS.startswith(call.arguments) and '"options": {' in call.arguments
        assert call.status == "incomplete" and whole.status == "incomplete"


@pytest.mark.parametrize("where", ["before", "inside"])
def test_thinking_then_a_streamed_call_on_chat_and_anthropic(client, claude, where):
    """Thinking is split off first (reasoning_content / a thinking block, never content or arguments);
    the content then streams its call in fragments that join to the whole answer's arguments. Thinking
    written inside a call's body comes after the call, so nothing interrupts the call's fragments."""
    messages = [{"role": "user", "content": f"think {where}, then write the file"}]
    assert parse_generated(THINKING_ANSWERS[where]).reasoning == THOUGHT
    whole = client.chat.completions.create(model="m", messages=messages, tools=[WRITE_TOOL]).choices[0]
    assert whole.message.model_extra["reasoning_content"] == THOUGHT
    assert whole.message.content == "I will write it. " and whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.arguments == EXPECTED_ARGUMENTS
    chunks = [c.choices[0] for c in client.chat.completions.create(model="m", messages=messages, tools=[WRITE_TOOL],
                                                                   stream=True) if c.choices]
    kinds = [("reasoning" if (c.delta.model_extra or {}).get("reasoning_content") else
              "content" if c.delta.content else "call" if c.delta.tool_calls else None) for c in chunks]
    assert "".join((c.delta.model_extra or {}).get("reasoning_content") or "" for c in chunks) == THOUGHT
    assert "".join(c.delta.content or "" for c in chunks) == "I will write it. "
    start, *fragments = [d for c in chunks for d in c.delta.tool_calls or []]
    assert start.function.name == "write_file" and start.id.startswith("call_")
    assert len(fragments) > 10 and "".join(d.function.arguments for d in fragments) == call.function.arguments
    calls = [i for i, kind in enumerate(kinds) if kind == "call"]
    assert calls == list(range(calls[0], calls[-1] + 1))  # the call's chunks are contiguous
    reasoning = [i for i, kind in enumerate(kinds) if kind == "reasoning"]
    assert (reasoning[-1] < kinds.index("content")) if where == "before" else (reasoning[0] > calls[-1])
    assert chunks[-1].finish_reason == "tool_calls"

    tool = {"name": "write_file", "input_schema": WRITE_TOOL["function"]["parameters"]}
    req = dict(model="m", max_tokens=400, messages=messages, tools=[tool])
    events = list(claude.messages.create(**req, stream=True))
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta"]
    assert len(partial) > 10 and "".join(partial) == EXPECTED_ARGUMENTS
    message = claude.messages.create(**req)
    with claude.messages.stream(**req) as stream:
        streamed = stream.get_final_message()
    want = ["thinking", "text", "tool_use"] if where == "before" else ["text", "tool_use", "thinking"]
    assert [b.type for b in message.content] == [b.type for b in streamed.content] == want
    (thinking,) = [b for b in message.content if b.type == "thinking"]
    (tool_use,) = [b for b in message.content if b.type == "tool_use"]
    assert thinking.thinking == THOUGHT and tool_use.input == json.loads(EXPECTED_ARGUMENTS)
    assert message.stop_reason == streamed.stop_reason == "tool_use"
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [b.model_dump(exclude={"id"})
                                                                          for b in message.content]


# ---------------------------------------------------------------- CORS, max tokens, /v1/models

PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type,x-api-key,anthropic-version"}


def test_cors_preflight_when_enabled_even_with_an_api_key():
    _, thread = _serve(ScriptedEngine(), cors_origins="https://app.example, https://other.example", api_key="k")
    with thread as url:
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
            r = httpx.options(url + path, headers=PREFLIGHT)
            assert r.status_code == 200, path
            assert r.headers["access-control-allow-origin"] == "https://app.example"
            assert {m.strip() for m in r.headers["access-control-allow-methods"].split(",")} == {"GET", "POST", "OPTIONS"}
            allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
            assert {"authorization", "content-type", "x-api-key", "anthropic-version"} <= allowed
        r = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example"})  # the 401 carries them too
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.options(url + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    _, thread = _serve(ScriptedEngine(), cors_origins="*")
    with thread as url:
        r = httpx.options(url + "/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "https://app.example")


def test_no_cors_headers_by_default(server):
    url = server[2]
    r = httpx.options(url + "/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 405 and not any(h.startswith("access-control-") for h in r.headers)
    r = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "Say hello"}),
])
def test_max_tokens_and_max_completion_tokens(server, path, body):
    post = lambda **extra: httpx.post(server[2] + path, json={"model": "m", **body, **extra})
    for limit in ({"max_tokens": 2}, {"max_completion_tokens": 2}, {"max_tokens": 2, "max_completion_tokens": 2}):
        r = post(**limit)
        assert r.status_code == 200, (limit, r.text)
        assert r.json()["usage"]["completion_tokens"] == 2 and r.json()["choices"][0]["finish_reason"] == "length"
    r = post(max_tokens=2, max_completion_tokens=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert "max_tokens" in r.json()["error"]["message"] and r.json()["error"]["code"] == "invalid_value"
    r = post(max_completion_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    for name in ("max_tokens", "max_completion_tokens"):   # past the whole context: the 400 names the field sent
        r = post(**{name: server[0].max_context + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == name and name in r.json()["error"]["message"]


def test_models_report_the_context_length(server):
    (entry,) = httpx.get(server[2] + "/v1/models").json()["data"]
    assert entry["context_length"] == entry["max_model_len"] == server[0].max_context == 8192
