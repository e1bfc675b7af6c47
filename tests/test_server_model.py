"""The real path: the server on the bundled Gemma 3 270M model, driven with the `openai` client.

- A drafted server and a no-draft server (the same loaded weights, one engine with the n-gram
  drafter and one without, which is what `--no-draft` builds) answer the same chat and completion
  requests identically, while the drafted one really drafts.
- Streaming returns the same text as non-streaming; concurrent clients get what they get alone.
- `python -m server` as a subprocess: the start-up log names model, quantization, device, index and
  the verify cost curve; a corrupted index is refused with its reason and the server drafts from
  the live context alone, its output still plain decoding's.
The model is a base model (it does not call tools); tool-call protocol details are in
test_server_protocol.py. Short max_tokens keep the module around a minute on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from ngram.drafter import DrafterConfig, NgramDrafter
from bench.live_server import ServerThread, free_port
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.serving import Service
from server.settings import Settings
from tests.test_engine_lossless import run

pytestmark = pytest.mark.slow
MAX_TOKENS = 24

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CHATS = [
    dict(messages=[{"role": "user", "content": "List the numbers 1, 2, 3, 4, 5, 6, 7, 8 and continue: 1, 2, 3,"}]),
    dict(messages=[{"role": "system", "content": "You call tools."},
                   {"role": "user", "content": "What is the weather in Paris? And in Rome? And in Oslo?"}],
         tools=[WEATHER_TOOL]),
    dict(messages=[{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "temp_c": 21}'}],
         tools=[WEATHER_TOOL]),
]
PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fib2(n):\n"


@pytest.fixture(scope="module")
def target():
    from server.model_loading import load_target

    return load_target(None)


@pytest.fixture(scope="module")
def servers(target):
    """(drafted url, plain url). Fixed flat policy: every non-empty draft is verified (most rollbacks)."""
    config = EngineConfig(max_draft=8, adaptive=False)
    drafted = Service(Engine(target, NgramDrafter(None, DrafterConfig()), config), Settings(trace_log=False))
    plain = Service(Engine(target, None, config), Settings(trace_log=False, draft=False))
    with ServerThread(create_app(drafted)) as a, ServerThread(create_app(plain)) as b:
        yield a, b


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def _answer(r) -> tuple:
    m = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return m.content, calls, r.choices[0].finish_reason


def test_drafted_server_equals_no_draft_server(servers):
    drafted, plain = _client(servers[0]), _client(servers[1])
    accepted = 0
    for req in CHATS:
        a = drafted.chat.completions.create(model="gemma", max_tokens=MAX_TOKENS, **req)
        b = plain.chat.completions.create(model="gemma", max_tokens=MAX_TOKENS, **req)
        assert _answer(a) == _answer(b)
        assert a.usage.completion_tokens == b.usage.completion_tokens
        assert b.usage.model_extra["sailfish"]["drafted_tokens"] == 0
        accepted += a.usage.model_extra["sailfish"]["accepted_tokens"]
    a = drafted.completions.create(model="gemma", prompt=PROMPT, max_tokens=MAX_TOKENS)
    b = plain.completions.create(model="gemma", prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    accepted += a.usage.model_extra["sailfish"]["accepted_tokens"]
    assert accepted > 0, "the drafted server never accepted a drafted token: the check proves nothing"
    metrics = httpx.get(servers[0] + "/metrics").text
    assert "spec_decode_num_accepted_tokens_total 0\n" not in metrics


def test_strict_tools_under_auto_drafted_equals_plain(servers):
    """tool_choice "auto" with a strict tool (what the OpenAI Agents SDK sends): the reply is free
    text then calls that follow the schema (the grammar of server.tool_grammars, optional calls), the
    drafted server's the plain server's, token for token."""
    strict_weather = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True, "parameters": {
        **WEATHER_TOOL["function"]["parameters"], "additionalProperties": False}}}
    drafted, plain = _client(servers[0]), _client(servers[1])
    seen = []
    for req in CHATS[1:]:
        req = {**req, "tools": [strict_weather], "parallel_tool_calls": False}  # (one call at most: enforced too)
        a = drafted.chat.completions.create(model="gemma", max_tokens=48, **req)
        b = plain.chat.completions.create(model="gemma", max_tokens=48, **req)
        assert _answer(a) == _answer(b)
        content, calls, finish = _answer(a)
        assert "<|tool_call>" not in (content or ""), content
        assert len(calls) <= 1
        for name, arguments in calls if finish == "tool_calls" else []:  # (max_tokens may cut a call)
            assert name == "get_weather" and set(json.loads(arguments)) == {"city"}, calls
        seen.append(finish)
    assert "tool_calls" in seen  # (the second conversation calls the tool, as its first turn did)


def test_strict_tools_put_auto_under_the_grammar(target):
    """On the bundled model's tokenizer a strict tool under tool_choice "auto" gets the optional-calls
    grammar: text, or a call that follows the schema; a call breaking it is cut where it breaks."""
    from server.protocol import ChatCompletionRequest

    service = Service(Engine(target, None, EngineConfig()), Settings(trace_log=False, draft=False))
    strict = {**WEATHER_TOOL["function"], "strict": True}
    req = ChatCompletionRequest.parse({"messages": CHATS[1]["messages"], "tools": [{"type": "function",
                                                                                    "function": strict}]})
    constraint = service._constraint(req, req.tools)
    loose = ChatCompletionRequest.parse({"messages": CHATS[1]["messages"], "tools": [WEATHER_TOOL]})
    assert constraint is not None and service._constraint(loose, loose.tools) is None
    tok = target.tokenizer

    def taken(text: str) -> bool:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return constraint.start([tok.eos_token_id]).validate_tokens(ids) == len(ids)

    assert taken("It is sunny.") and taken('<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>')
    assert not taken("<|tool_call>call:get_weather{town:") and not taken("<|tool_call>call:get_time{")


def test_streaming_equals_non_streaming(servers):
    c = _client(servers[0])
    req = dict(model="gemma", max_tokens=MAX_TOKENS, **CHATS[0])
    whole = c.chat.completions.create(**req)
    chunks = list(c.chat.completions.create(**req, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def _metric(url: str, name: str) -> float:
    line = next(ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def test_a_next_turn_reuses_the_tokens_of_the_turn_before(servers, target):
    """An agent's next turn resends the conversation: the server tokenizes only its tail
    (common.prompt_tokens), and the prompt it serves is the conversation tokenized whole."""
    from common.chat_format import ChatFormat
    from server.protocol import parse_messages, parse_tools

    c = _client(servers[0])
    first = [{"role": "system", "content": "You call tools. " * 40}, *CHATS[2]["messages"]]
    r1 = c.chat.completions.create(model="gemma", max_tokens=8, messages=first, tools=[WEATHER_TOOL])
    reused = _metric(servers[0], "sailfish_prompt_tokenizer_reused_tokens_total")
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content or "It is sunny."},
                      {"role": "user", "content": "And in Rome?"}]
    r2 = c.chat.completions.create(model="gemma", max_tokens=8, messages=second, tools=[WEATHER_TOOL])
    fmt = ChatFormat.for_tokenizer(target.tokenizer)
    text = fmt.render_prompt(parse_messages(second), parse_tools([WEATHER_TOOL]), "auto")
    assert r2.usage.prompt_tokens == len(target.tokenizer.encode(text, add_special_tokens=False))
    # the first turn's prompt came from its tokens, but for its last lines (the cut must lie an added
    # token's length before where the two prompts part: common/prompt_tokens.py)
    assert _metric(servers[0], "sailfish_prompt_tokenizer_reused_tokens_total") - reused >= r1.usage.prompt_tokens - 80


def test_an_anthropic_clients_next_turn_reuses_the_turn_before_too(servers):
    """Claude Code's way in (the Messages API, system blocks and tools as it sends them): its next
    turn's prompt is tokenized from the turn before's tokens as well."""
    import anthropic

    from tests.test_anthropic_api import WEATHER_TOOL as tool   # the same tool in the Messages API's shape

    c = anthropic.Anthropic(base_url=servers[0], api_key="x", max_retries=0, timeout=120)
    system = [{"type": "text", "text": "You are a coding agent. " * 40, "cache_control": {"type": "ephemeral"}}]
    turn = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r1 = c.messages.create(model="gemma", max_tokens=8, system=system, tools=[tool], messages=turn)
    reused = _metric(servers[0], "sailfish_prompt_tokenizer_reused_tokens_total")
    turn += [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And in Rome?"}]
    c.messages.create(model="gemma", max_tokens=8, system=system, tools=[tool], messages=turn)
    first = r1.usage.input_tokens + (r1.usage.cache_read_input_tokens or 0)
    assert _metric(servers[0], "sailfish_prompt_tokenizer_reused_tokens_total") - reused >= first - 80


def test_concurrent_clients_get_their_solo_output(servers):
    """Requests sent at once to the drafted server each get the plain server's answer alone."""
    c = _client(servers[0])
    prompts = [f"Count from {k}: {k}, {k + 1}," for k in (3, 40, 700)]
    plain = _client(servers[1])
    solo = [plain.completions.create(model="m", prompt=p, max_tokens=16).choices[0].text for p in prompts]
    out: dict[int, str] = {}

    def send(i):
        out[i] = c.completions.create(model="m", prompt=prompts[i], max_tokens=16).choices[0].text

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(prompts))] == solo


def test_refused_index_drafts_from_the_context_and_says_why(tmp_path):
    """A broken index is refused with the loader's message; the server still drafts from the live
    context (no index needed), its output equal to plain decoding's."""
    from server.serving import load_engine
    from server.settings import Settings

    bad_index = tmp_path / "index"
    bad_index.mkdir()
    (bad_index / "meta.msgpack").write_bytes(b"\x00garbage")
    engine, note = load_engine(Settings(index=str(bad_index)))
    assert engine._drafter is not None and engine._drafter.index is None
    assert "no usable index" in note and "live context" in note and "rebuild" in note
    tok = engine.tokenizer
    prompt = tok("def area(width, height):\n    return width * height\n\n" * 6 + "def area(width,",
                 add_special_tokens=False)["input_ids"]
    drafted, *_, stats = run(engine, prompt, max_tokens=24)
    plain, *_ = run(engine, prompt, max_tokens=24, draft=False)
    assert drafted == plain
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0


def test_cli_server_startup_log(tmp_path):
    import numpy as np

    from common.tokenizer import load_tokenizer, tokenizer_fingerprint
    from ngram.index_file import BuildParams, write_index

    index_dir = tmp_path / "index"
    fingerprint = tokenizer_fingerprint(load_tokenizer())
    write_index(index_dir, [np.arange(100, 140, dtype=np.uint32)], fingerprint, BuildParams())
    port = free_port()
    log_path = tmp_path / "server.log"
    env = dict(os.environ, SAILFISH_HOME=str(tmp_path / "home"))
    root = Path(__file__).resolve().parent.parent
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "server", "--port", str(port), "--index", str(index_dir),
                                 "--max-draft", "2"], cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        c = _client(f"http://127.0.0.1:{port}")
        assert [m.id for m in c.models.list().data] == ["gemma-3-270m"]
        r = c.chat.completions.create(model="gpt-4o", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        assert r.usage.completion_tokens >= 1
        # Ctrl-C with a long generation running: it stops at its next step, its client is told, and
        # the server exits at once, quietly, with status 0
        last: list = []

        def long_stream():
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
                    "model": "m", "stream": True, "max_tokens": 3000,
                    "messages": [{"role": "user", "content": "Write a very long story."}]}) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data:"):
                        last.append(line)

        streaming = threading.Thread(target=long_stream)
        streaming.start()
        while len(last) < 3:
            time.sleep(0.05)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0 and time.monotonic() - stopped < 10
        streaming.join(timeout=10)
        assert json.loads(last[-1][len("data:"):])["error"]["code"] == "server_shutting_down"
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)
    text = log_path.read_text()
    assert "Traceback" not in text and text.rstrip().endswith("stopped")
    assert "model gemma-3-270m: quant none, dtype float32, device cpu" in text
    assert f"index {index_dir}: 1 turns" in text and "verify cost curve" in text and "1:1.00" in text
    # the completed chat request was captured in the default trace directory
    traces = list((tmp_path / "home" / "traces").glob("*.jsonl"))
    assert len(traces) == 1 and '"role": "assistant"' in traces[0].read_text()
