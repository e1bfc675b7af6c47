"""Gemma 4's thinking channel (`<|channel>thought\\n...<channel|>`): parsed out of generated text into
reasoning, never content; rendered back as the Gemma 4 template does; served as `reasoning_content`
(chat completions), `thinking` blocks (Messages) and `reasoning` items (Responses).

The HTTP tests serve test_server_protocol's SCRIPTED STAND-IN ENGINE with a script that thinks first;
it emits three characters per token, so the channel markers arrive split across deltas.
"""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from common.chat_format import (CONTENT, REASONING, ChatFormat, ThinkingStreamParser, parse_generated,
                                strip_thinking)
from tests.test_server_protocol import PARIS_CALL, WEATHER_TOOL, ScriptedEngine, default_script, serving

THOUGHT = "The user asks for a number.\nForty-two fits."
ANSWER = "The answer is 42."
TOOL_THOUGHT = "I need the weather tool."
THINKING_ANSWER = f"<|channel>thought\n{THOUGHT}\n<channel|>{ANSWER}<turn|>"
THINKING_CALL = f"<|channel>thought\n{TOOL_THOUGHT}\n<channel|>{PARIS_CALL}<|tool_response>"


def thinking_script(prompt: str) -> str:
    """The stand-in model thinks before it answers when the last user message says "think"."""
    last_user = prompt.rsplit("<|turn>user\n", 1)[-1]
    if prompt.endswith("<tool_response|>") or "think" not in last_user:
        return default_script(prompt)
    if "weather" in last_user and "<|tool>declaration:get_weather" in prompt:
        return THINKING_CALL
    if "unfinished" in last_user:
        return f"<|channel>thought\n{THOUGHT}"  # cut off while thinking (the end of the script)
    return THINKING_ANSWER


def _segments(chunks: list[str]) -> list[tuple[str, str]]:
    """Stream `chunks` through a ThinkingStreamParser; the segments merged by kind, in order."""
    parser, merged = ThinkingStreamParser(), []
    for segment in [s for chunk in chunks for s in parser.feed(chunk)] + parser.finish():
        if merged and merged[-1][0] == segment[0]:
            merged[-1] = (segment[0], merged[-1][1] + segment[1])
        else:
            merged.append(segment)
    return merged


# ---------------------------------------------------------------- parsing


def test_parse_generated_separates_thinking_from_content_and_calls():
    turn = parse_generated(THINKING_ANSWER)
    assert (turn.reasoning, turn.content, turn.tool_calls) == (THOUGHT, ANSWER, [])
    turn = parse_generated(THINKING_CALL)
    assert (turn.reasoning, turn.content) == (TOOL_THOUGHT, "")
    assert turn.tool_calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    plain = parse_generated("Hello <b>there</b><turn|>")
    assert (plain.reasoning, plain.content) == ("", "Hello <b>there</b>")


@pytest.mark.parametrize("text", [THINKING_ANSWER, THINKING_CALL, f"Before.<|channel>thought\n{THOUGHT}<channel|>After."])
def test_every_split_of_the_markers_streams_as_the_whole_text_parses(text):
    whole = _segments([text])
    for cut in range(1, len(text)):
        assert _segments([text[:cut], text[cut:]]) == whole, cut
    assert _segments(list(text)) == whole
    assert all("<|channel>" not in part and "<channel|>" not in part for kind, part in whole)


def test_no_markup_is_released_early_and_content_without_thinking_is_untouched():
    parser = ThinkingStreamParser()
    assert parser.feed("Hi <|chan") == [(CONTENT, "Hi ")]       # a possible marker is held back
    assert parser.feed("nel>tho") == []                          # the label may still come
    assert parser.feed("ught\nhmm\n<chan") == [(REASONING, "hmm")]  # the newline before the close is markup
    assert parser.feed("nel|>ok") == [(CONTENT, "ok")]
    assert parser.finish() == []
    assert _segments(["a < b and <|x> <channel|> stay"]) == [(CONTENT, "a < b and <|x> <channel|> stay")]
    assert _segments(["ends with <|chan"]) == [(CONTENT, "ends with <|chan")]  # an unfinished marker is text


def test_thinking_still_open_at_the_end_is_reasoning_never_content():
    assert _segments([f"<|channel>thought\n{THOUGHT}\n"]) == [(REASONING, THOUGHT + "\n")]
    assert _segments(["<|channel>thou"]) == []                   # only the label: markup
    assert _segments(["<|channel>no label"]) == [(REASONING, "no label")]
    turn = parse_generated(f"<|channel>thought\n{THOUGHT}")
    assert (turn.reasoning, turn.content) == (THOUGHT, "")


# ---------------------------------------------------------------- rendering

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_reasoning_renders_only_in_the_tool_loop_in_progress():
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "", "reasoning_content": "old thought", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "old answer thought"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "", "reasoning_content": TOOL_THOUGHT, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "rainy"},
    ]
    prompt = ChatFormat().render_prompt(messages, [WEATHER_TOOL])
    assert "old thought" not in prompt and "old answer thought" not in prompt  # earlier turns: dropped
    assert (f"<|turn>user\nagain<turn|>\n<|turn>model\n<|channel>thought\n{TOOL_THOUGHT}\n<channel|>"
            + PARIS_CALL + "<|tool_response>response:get_weather") in prompt
    # what the model generated for that message is the thinking too, and parses back to it
    generated = ChatFormat().assistant_turns(messages, [WEATHER_TOOL])[-1][1]
    assert generated == THINKING_CALL
    assert parse_generated(generated).reasoning == TOOL_THOUGHT
    # an answer without tool calls after the last user message renders no thinking either (the template's gate)
    answer = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ANSWER, "reasoning": THOUGHT}]
    assert THOUGHT not in ChatFormat().render(answer, [])


def test_content_with_channel_markup_is_stripped_as_the_template_does():
    assert strip_thinking(f" <|channel>thought\n{THOUGHT}<channel|> {ANSWER} ") == ANSWER
    assert strip_thinking("a<|channel>x<channel|>b<|channel>unclosed") == "ab"
    assert strip_thinking("  untouched  ") == "  untouched  "
    text = ChatFormat().render([{"role": "user", "content": "q"},
                                {"role": "assistant", "content": f"<|channel>thought\n{THOUGHT}<channel|>{ANSWER}"},
                                {"role": "user", "content": "r"}], [])
    assert f"<|turn>model\n{ANSWER}<turn|>\n" in text and THOUGHT not in text


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def server():
    yield from serving(ScriptedEngine(thinking_script))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[2] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[2], api_key="unused", max_retries=0)


def _ask(text: str, **kw) -> dict:
    return dict(model="m", messages=[{"role": "user", "content": text}], **kw)


def _streamed(client, **kw) -> tuple[str, str, dict, str]:
    """(reasoning, content, {index: (name, arguments)}, finish_reason) of a streamed chat answer."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, arguments = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_chat_gives_reasoning_content_apart_from_content(client):
    r = client.chat.completions.create(**_ask("think: what is the answer?"))
    message = r.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == THOUGHT == message.model_dump()["reasoning_content"]
    assert r.choices[0].finish_reason == "stop"
    assert _streamed(client, **_ask("think: what is the answer?")) == (THOUGHT, ANSWER, {}, "stop")


def test_chat_thinking_then_a_tool_call_streamed_and_whole(client):
    kw = _ask("think: what is the weather in Paris?", tools=[WEATHER_TOOL])
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == TOOL_THOUGHT and not message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
           [("get_weather", {"city": "Paris"})]
    assert r.choices[0].finish_reason == "tool_calls"
    assert _streamed(client, **kw) == (TOOL_THOUGHT, "", {0: ("get_weather", '{"city": "Paris"}')}, "tool_calls")


def test_thinking_cut_off_stays_reasoning_and_no_thinking_adds_no_field(client):
    r = client.chat.completions.create(**_ask("think, unfinished"))
    assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == ("", THOUGHT)
    assert _streamed(client, **_ask("think, unfinished")) == (THOUGHT, "", {}, "stop")
    plain = client.chat.completions.create(**_ask("hi"))
    assert "reasoning_content" not in plain.choices[0].message.model_dump()
    assert _streamed(client, **_ask("hi"))[0] == ""


def test_reasoning_content_sent_back_renders_in_the_tool_loop(server, client):
    messages = [{"role": "user", "content": "think: what is the weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": TOOL_THOUGHT, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert server[0].prompts[-1].endswith(THINKING_CALL + "response:get_weather{value:<|\"|>sunny<|\"|>}<tool_response|>")


def test_messages_api_gives_a_thinking_block_then_text(claude):
    kw = dict(model="claude", max_tokens=200, messages=[{"role": "user", "content": "think: the answer?"}],
              thinking={"type": "adaptive"})
    r = claude.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert (r.content[0].thinking, r.content[0].signature, r.content[1].text) == (THOUGHT, "", ANSWER)
    with claude.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude={"id", "usage"}) == r.model_dump(exclude={"id", "usage"})


def test_messages_api_thinking_then_tool_use_and_back(server, claude):
    kw = dict(model="claude", max_tokens=200, tools=[{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}],
              messages=[{"role": "user", "content": "think: what is the weather in Paris?"}])
    r = claude.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "tool_use"] and r.stop_reason == "tool_use"
    assert r.content[0].thinking == TOOL_THOUGHT and r.content[1].input == {"city": "Paris"}
    with claude.messages.stream(**kw) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    without_ids = lambda m: [{k: v for k, v in b.items() if k != "id"} for b in m.model_dump()["content"]]
    assert without_ids(streamed) == without_ids(r) and streamed.stop_reason == r.stop_reason
    assert deltas[0] == "thinking_delta" and deltas[-1] == "input_json_delta"
    back = claude.messages.create(**{**kw, "messages": kw["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.content[1].id, "content": "sunny"}]}]})
    assert back.content[0].text == "It is sunny in Paris."
    assert f"<|channel>thought\n{TOOL_THOUGHT}\n<channel|><|tool_call>" in server[0].prompts[-1]


def test_responses_api_gives_a_reasoning_item_then_the_message(server, client):
    r = client.responses.create(model="m", input="think: the answer?")
    assert [item.type for item in r.output] == ["reasoning", "message"]
    reasoning = r.output[0]
    assert reasoning.summary == [] and [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THOUGHT)]
    assert r.output_text == ANSWER
    events = list(client.responses.create(model="m", input="think: the answer?", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    final = events[-1].response
    assert final.model_dump(exclude={"id", "created_at", "completed_at", "usage", "output"}) == \
           r.model_dump(exclude={"id", "created_at", "completed_at", "usage", "output"})
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [i.model_dump(exclude={"id"}) for i in r.output]
    # the output sent back as input: the reasoning item joins the tool-call turn it precedes
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    first = client.responses.create(model="m", input="think: what is the weather in Paris?", tools=[tool])
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    again = client.responses.create(model="m", tools=[tool], input=[
        {"role": "user", "content": "think: what is the weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert again.output_text == "It is sunny in Paris."
    assert f"<|channel>thought\n{TOOL_THOUGHT}\n<channel|><|tool_call>" in server[0].prompts[-1]
