"""`POST /v1/responses`, driven with the official `openai` client's Responses API and with an
`openai-agents` Agent, over real HTTP against the scripted stand-in engine of test_server_protocol.py.

The stand-in replays fixed Gemma 4 text chosen from the rendered prompt (`responses_script` adds the
Agent's tool turn and its answer to test_server_protocol's script), so these tests check the
translation both ways: Responses input -> the prompt the model sees, generated text -> Response items
and stream events.
"""
from __future__ import annotations

import asyncio
import json
import re

import agents
import httpx
import openai
import pytest

from tests.test_server_protocol import ScriptedEngine, _serve, default_script, serving

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME_TOOL = {"type": "function", "name": "get_time",
             "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}
WEATHER_QUESTION = "What is the weather in Paris?"
ORDER_CALL = '<|tool_call>call:get_order_status{order_id:<|"|>42<|"|>}<tool_call|><|tool_response>'
_ORDER_RESULT = re.compile(r'response:get_order_status\{value:<\|"\|>(.*?)<\|"\|>\}<tool_response\|>$')


def responses_script(prompt: str) -> str:
    """test_server_protocol's script, plus an order-status tool turn and an answer quoting its result."""
    result = _ORDER_RESULT.search(prompt)
    if result:
        return f"Order 42 is {result.group(1)}.<turn|>"
    last_user = prompt.rsplit("<|turn>user\n", 1)[-1]
    if "order 42" in last_user and "<|tool>declaration:get_order_status" in prompt:
        return "Looking it up. " + ORDER_CALL
    return default_script(prompt)


@pytest.fixture(scope="module")
def server():
    yield from serving(ScriptedEngine(script=responses_script))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[2] + "/v1", api_key="unused", max_retries=0)


def test_text_reply(server, client):
    r = client.responses.create(model="gpt-4o", input="hi", instructions="Be brief.", metadata={"k": "v"})
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.model == "scripted-stand-in" and r.error is None and r.incomplete_details is None
    (message,) = r.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == "Hello there! How can I help you today?" and message.content[0].annotations == []
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    assert "drafted_tokens" in u.model_extra["sailfish"]
    assert r.metadata == {"k": "v"} and r.instructions == "Be brief." and r.model_extra["store"] is False
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True
    prompt = server[0].prompts[-1]
    assert prompt.startswith("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nhi<turn|>\n")


def test_stream_event_order_and_text(client):
    whole = client.responses.create(model="m", input="hi")
    events = list(client.responses.create(model="m", input="hi", stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(d.delta for d in deltas)
    final = events[-1].response
    assert text == final.output_text == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    assert final.output[0].id == item_id and final.id == events[0].response.id
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_call_round_trip(server, client):
    r = client.responses.create(model="m", input=WEATHER_QUESTION, tools=[WEATHER_TOOL])
    assert r.status == "completed" and [item.type for item in r.output] == ["message", "function_call"]
    assert r.output_text == "Let me check. "
    call = r.output[1]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    assert "<|tool>declaration:get_weather{description:<|\"|>Current weather in a city<|\"|>" in server[0].prompts[-1]

    history = [{"role": "user", "content": WEATHER_QUESTION}, *[item.model_dump() for item in r.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}]
    r2 = client.responses.create(model="m", input=history, tools=[WEATHER_TOOL])
    assert r2.output_text == "It is sunny in Paris." and [item.type for item in r2.output] == ["message"]
    prompt = server[0].prompts[-1]
    assert prompt.endswith("<|turn>model\nLet me check. <|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}"
                           "<tool_call|><|tool_response>response:get_weather{sky:<|\"|>sunny<|\"|>}<tool_response|>")


def test_function_call_stream_events(client):
    events = list(client.responses.create(model="m", input="weather and time, both please",
                                             tools=[WEATHER_TOOL, TIME_TOOL], stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call", "function_call"]
    assert [e.output_index for e in added] == [0, 1] and added[0].item.arguments == ""
    done = {e.output_index: e for e in events if e.type == "response.function_call_arguments.done"}
    arguments = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            arguments[e.output_index] = arguments.get(e.output_index, "") + e.delta
    assert arguments == {i: done[i].arguments for i in done}
    assert json.loads(done[1].arguments) == {"tz": "Europe/Paris"}
    final = events[-1]
    assert final.type == "response.completed"
    assert [(item.name, item.arguments) for item in final.response.output] == [
        ("get_weather", done[0].arguments), ("get_time", done[1].arguments)]
    assert len({item.call_id for item in final.response.output}) == 2


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="m", input="hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Hello " and r.output[0].status == "incomplete" and r.max_output_tokens == 2
    events = list(client.responses.create(model="m", input="hi", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_tool_choice_none_named_required(server, client):
    r = client.responses.create(model="m", input=WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice="none")
    assert "declaration:get_weather" not in server[0].prompts[-1] and r.output[0].type == "message"
    r = client.responses.create(model="m", input=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                tool_choice={"type": "function", "name": "get_weather"})
    assert server[0].prompts[-1].endswith("<|turn>model\n<|tool_call>call:get_weather{")
    assert r.output[0].type == "function_call" and json.loads(r.output[0].arguments) == {"city": "Paris"}
    assert r.tool_choice.name == "get_weather"
    r = client.responses.create(model="m", input="hi", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    assert [item.name for item in r.output] == ["get_time"]


def test_input_items_and_sampling_fields(server, client):
    r = client.responses.create(model="m", store=False, temperature=0, top_p=1.0, include=[], truncation="disabled",
                                user="u1", parallel_tool_calls=True, reasoning=None, text={"format": {"type": "text"}},
                                input=[{"type": "message", "role": "developer", "content": "Rule one."},
                                       {"role": "user", "content": [{"type": "input_text", "text": "h"},
                                                                    {"type": "input_text", "text": "i"}]}])
    assert r.output_text.startswith("Hello there") and r.temperature == 0.0 and r.top_p == 1.0
    assert server[0].prompts[-1].startswith("<bos><|turn>system\nRule one.<turn|>\n<|turn>user\nhi<turn|>")


@pytest.mark.parametrize("body, param, code", [
    ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id", "unsupported_value"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "unsupported_value"),
    ({"input": "hi", "some_vendor_field": 1}, "some_vendor_field", "unknown_parameter"),
    ({"input": "hi", "store": True}, "store", "unsupported_value"),
    ({"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options", "invalid_value"),
    ({"input": "hi", "stream": True, "stream_options": {"include_usage": True}}, "stream_options",
     "unsupported_value"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "unsupported_value"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format",
     "unsupported_value"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "unsupported_value"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include", "unsupported_value"),
    ({"input": "hi", "include": [{"not": "a string"}]}, "include", "unsupported_value"),
    ({"input": "hi", "max_tool_calls": 3}, "max_tool_calls", "unsupported_value"),
    ({}, "input", "missing_required_parameter"),
    ({"input": []}, "input", "empty_array"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "unsupported_value"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "unsupported_value"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "unsupported_value"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
     "missing_required_parameter"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "a b"}]}, "input[0].name", "invalid_value"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", "missing_required_parameter"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_value"),
    ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", "invalid_value"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     "tools[0].parameters", "invalid_function_parameters"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
     "invalid_value"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "invalid_value"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "parallel_tool_calls": False}, "parallel_tool_calls",
     "unsupported_value"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "hi", "temperature": 7}, "temperature", "invalid_value"),
])
def test_bad_requests_get_openai_errors(server, body, param, code):
    r = httpx.post(server[2] + "/v1/responses", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and (err["param"], err["code"]) == (param, code) and err["message"]


def test_server_keeps_serving_after_bad_input(server, client):
    r = httpx.post(server[2] + "/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", previous_response_id="resp_123")
    assert e.value.status_code == 400 and e.value.body["param"] == "previous_response_id"
    r = httpx.get(server[2] + "/v1/responses/resp_123")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert client.responses.create(model="m", input="hi").output_text.startswith("Hello")


def test_error_after_streaming_began_is_an_error_event(client):
    events = list(client.responses.create(model="m", input="crash now", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    error = events[-1]
    assert error.code == "internal_error" and "secret" not in error.message and error.sequence_number == 2
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model="m", input="crash now")
    assert client.responses.create(model="m", input="hi").status == "completed"


def test_context_errors_name_the_responses_parameters():
    service, thread = _serve(ScriptedEngine(max_context=64))
    with thread as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="m", input="x" * 200)
        assert (e.value.body["param"], e.value.body["code"]) == ("input", "context_length_exceeded")
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="m", input="hi", max_output_tokens=65)
        assert e.value.body["param"] == "max_output_tokens" and "max_output_tokens" in e.value.body["message"]


@pytest.mark.parametrize("req", [
    dict(input="hi"), dict(input="hi", max_output_tokens=3),
    dict(input=WEATHER_QUESTION, tools=[WEATHER_TOOL]),
    dict(input="weather and time, both please", tools=[WEATHER_TOOL, TIME_TOOL], max_output_tokens=20),
    dict(input="hi", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required"),
])
def test_streamed_and_whole_responses_are_the_same(client, req):
    whole = client.responses.create(model="m", **req)
    streamed = list(client.responses.create(model="m", **req, stream=True))[-1].response
    shape = lambda r: (r.status, [(i.type, getattr(i, "name", None), getattr(i, "arguments", None),
                                   [c.text for c in getattr(i, "content", [])]) for i in r.output],
                       r.usage.output_tokens)
    assert shape(streamed) == shape(whole)


def test_openai_agents_tool_loop(server):
    agents.set_tracing_disabled(True)
    looked_up = []

    # strict_mode off: this scripted engine's tokenizer has no grammar compiler, so the SDK's default
    # strict tools are refused here (tests/test_server_protocol.py); on the real model they are enforced
    # (tests/test_server_model.py)
    @agents.function_tool(strict_mode=False)
    def get_order_status(order_id: str) -> str:
        """The shipping status of an order."""
        looked_up.append(order_id)
        return "shipped"

    async def run_both():
        model = agents.OpenAIResponsesModel(model="gemma", openai_client=openai.AsyncOpenAI(
            base_url=server[2] + "/v1", api_key="unused", max_retries=0))
        agent = agents.Agent(name="support", instructions="Answer order questions.", tools=[get_order_status],
                             model=model)
        whole = await agents.Runner.run(agent, "Where is order 42?")
        streamed = agents.Runner.run_streamed(agent, "Where is order 42?")
        async for _ in streamed.stream_events():
            pass
        return whole, streamed

    whole, streamed = asyncio.run(run_both())
    assert whole.final_output == streamed.final_output == "Order 42 is shipped."
    assert looked_up == ["42", "42"]
    kinds = [item.type for item in whole.new_items]
    assert kinds == ["message_output_item", "tool_call_item", "tool_call_output_item", "message_output_item"]
    assert server[0].prompts[-1].startswith("<bos><|turn>system\nAnswer order questions.<|tool>declaration:"
                                            "get_order_status{")


def test_a_function_call_output_answering_no_call_is_a_400(client):
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    ok = client.responses.create(model="m", input=[{"role": "user", "content": "hi"}, call,
                                                   {"type": "function_call_output", "call_id": "c1", "output": "r"}])
    assert ok.status == "completed"
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="m", input=[{"role": "user", "content": "hi"}, call,
                                                  {"type": "function_call_output", "call_id": "zz", "output": "r"}])
    assert bad.value.body["code"] == "invalid_tool_result"
