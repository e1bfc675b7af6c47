"""Built-in Gemma 4 rendering, parsing generated calls back, the streaming parser, token ids."""
import json

import pytest

from common.chat_format import (ChatFormat, ParsedTurn, ToolCallStreamer, ToolCallStreamParser, format_value,
                                parse_generated)

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Find files",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
                   "required": ["q"]}}}]
ARGS = {"q": "a, b: {c}", "n": 3, "deep": {"x": [1.5, True, None, "y"]}}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "find it"},
    {"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": json.dumps(ARGS)}},
        {"id": "c2", "type": "function", "function": {"name": "search", "arguments": '{"q": "z"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "plain text result"},
    {"role": "tool", "tool_call_id": "c2", "content": '{"hits": 0}'},
    {"role": "assistant", "content": "Nothing found."},
    {"role": "user", "content": "ok"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "search", "arguments": '{"q": "w"}'}}]},
]


def test_rendering_rules():
    text = ChatFormat().render(MESSAGES, TOOLS)
    assert text.startswith('<bos><|turn>system\nBe brief.<|tool>declaration:search{description:<|"|>Find files<|"|>,'
                           'parameters:{type:<|"|>object<|"|>,properties:{q:{type:<|"|>string<|"|>}')
    assert '<|turn>user\nfind it<turn|>\n<|turn>model\nLooking.<|tool_call>call:search{q:<|"|>a, b: {c}<|"|>,n:3,' \
           'deep:{x:[1.5,true,null,<|"|>y<|"|>]}}<tool_call|>' in text
    assert '<|tool_response>response:search{value:<|"|>plain text result<|"|>}<tool_response|>' \
           '<|tool_response>response:search{hits:0}<tool_response|>Nothing found.<turn|>\n' in text
    assert text.endswith('<|turn>model\n<|tool_call>call:search{q:<|"|>w<|"|>}<tool_call|><turn|>\n')
    assert format_value({"b": 1, "a": "s"}) == '{b:1,a:<|"|>s<|"|>}'  # key order kept


def test_assistant_turns_are_prefixes_and_match_render_prompt():
    cf = ChatFormat()
    full = cf.render(MESSAGES, TOOLS)
    turns = cf.assistant_turns(MESSAGES, TOOLS)
    at = [i for i, m in enumerate(MESSAGES) if m["role"] == "assistant"]
    assert len(turns) == len(at) == 3
    for (prompt, gen), i in zip(turns, at):
        assert full.startswith(prompt + gen)
        assert cf.render_prompt(MESSAGES[:i], TOOLS) == prompt
    assert turns[0][1].endswith("<tool_call|><|tool_response>")
    assert turns[1][0].endswith("<tool_response|>") and turns[1][1] == "Nothing found.<turn|>"
    assert turns[2][1].endswith("<tool_call|><turn|>")  # no tool result follows: the turn closes


def test_round_trip_render_then_parse():
    for (_, gen), m in zip(ChatFormat().assistant_turns(MESSAGES, TOOLS),
                           [m for m in MESSAGES if m["role"] == "assistant"]):
        parsed = parse_generated(gen)
        assert parsed.content == m["content"]
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls", [])]
        assert [(c["name"], json.loads(c["arguments"])) for c in parsed.tool_calls] == want


@pytest.mark.parametrize("text", [
    'x<|tool_call>call:search{q:<|"|>unterminated',
    'x<|tool_call>call:search{q:<|"|>a<|"|>,<tool_call|>',
    "x<|tool_call>nonsense<tool_call|>",
    "x<|tool_call>call:search{q:",
])
def test_garbled_or_truncated_call_stays_content(text):
    parsed = parse_generated(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_stream_parser_with_every_split():
    text = ('Sure <|tool_call>call:f{a:<|"|><x><|"|>,b:[1,2]}<tool_call|> and <|tool_cal'
            'l>call:g{}<tool_call|>< tail <|tool')
    want_content = "Sure  and < tail "  # the cut-off marker at the end is dropped; the lone "<" is text
    want_calls = [{"name": "f", "arguments": json.dumps({"a": "<x>", "b": [1, 2]})},
                  {"name": "g", "arguments": "{}"}]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            p = ToolCallStreamParser()
            content, calls = "", []
            for piece in (text[:i], text[i:j], text[j:]):
                c, k = p.feed(piece)
                assert "<tool_call|>" not in c and "call:" not in c
                assert not any(c.endswith("<|tool_call>"[:n]) for n in range(1, 12))  # held back
                content, calls = content + c, calls + k
            c, k = p.finish()
            assert content + c == want_content and calls + k == want_calls, (i, j)


def test_stream_parser_holds_back_partial_marker():
    p = ToolCallStreamParser()
    assert p.feed("hello <|tool") == ("hello ", [])
    assert p.feed("_call>call:f{}") == ("", [])
    assert p.feed("<tool_call|>!") == ("!", [{"name": "f", "arguments": "{}"}])


@pytest.mark.parametrize("text, content", [
    ("done <|tool", "done "), ("done <|", "done "), ("done <", "done <"),   # a lone "<" may be text
    ("done <|tool_call>", "done "), ("done <|tool_call>call:get_wea", "done "),
    ("done <|tool_call>nonsense", "done <|tool_call>nonsense"),           # not a call head: content
])
def test_markup_cut_off_before_a_call_name_is_complete_is_dropped(text, content):
    """Generation cut (max_tokens) inside `<|tool_call>` or before the call's name is complete leaves
    markup that is neither content nor a call: dropped, streamed or parsed whole."""
    assert parse_generated(text) == ParsedTurn(content=content)
    streamer = ToolCallStreamer()
    events = [e for ch in text for e in streamer.feed(ch)] + streamer.finish()
    assert "".join(events) == content



def test_forced_call_ends_the_prompt_and_the_parser_continues_it():
    cf, user = ChatFormat(), MESSAGES[:2]
    assert cf.forced_call("auto") == cf.forced_call("none") == ""
    assert cf.forced_call("required") == "<|tool_call>call:"
    assert cf.forced_call({"name": "search"}) == "<|tool_call>call:search{"
    for choice in ("auto", "required", {"name": "search"}):
        assert cf.render_prompt(user, TOOLS, choice) == cf.render_prompt(user, TOOLS) + cf.forced_call(choice)
    after_tool = MESSAGES[:5]  # the model turn continues after a tool result: the call comes right after it
    assert cf.render_prompt(after_tool, TOOLS, "required").endswith("<tool_response|><|tool_call>call:")
    p = ToolCallStreamParser(cf.forced_call({"name": "search"}))
    assert p.feed('q:<|"|>x<|"|>}') == ("", [])
    assert p.feed("<tool_call|>done") == ("done", [{"name": "search", "arguments": '{"q": "x"}'}])
    p = ToolCallStreamParser(cf.forced_call("required"))
    assert p.feed("sea") == ("", []) and p.finish() == ("", [])  # cut off before the name ends: dropped


class _FakeTemplateTokenizer:
    chat_template = "{% for m in messages %}...{% endfor %}{{ tools }}"
    bos_token = "<s>"

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
        text = "<s>" + "".join(f"[{m['role']}]{m.get('content') or ''}[end]" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")


def test_template_is_used_when_it_supports_tools():
    cf = ChatFormat.for_tokenizer(_FakeTemplateTokenizer())
    assert cf.uses_template
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert cf.assistant_turns(msgs, []) == [("<s>[user]hi[end][assistant]", "yo[end]")]
    assert cf.render_prompt(msgs[:1], []) == "<s>[user]hi[end][assistant]"
    # tool_choice is requested in a system message, never forced: the template's call syntax is its own
    assert cf.forced_call("required") == cf.forced_call({"name": "search"}) == ""
    assert cf.render_prompt(msgs[:1], TOOLS, {"name": "search"}) == \
        "<s>[system]You must call the tool search.[end][user]hi[end][assistant]"
    assert cf.render_prompt(msgs[:1], TOOLS, "required").startswith("<s>[system]You must call one of the tools.")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from common.bundled_model import bundled_model_dir

    return AutoTokenizer.from_pretrained(bundled_model_dir())


@pytest.mark.slow
def test_bundled_tokenizer_uses_builtin_format_and_prefix_property(tokenizer):
    cf = ChatFormat.for_tokenizer(tokenizer)
    assert not cf.uses_template and cf.bos == "<bos>"
    turns = cf.turn_token_ids(tokenizer, MESSAGES, TOOLS)
    texts = cf.assistant_turns(MESSAGES, TOOLS)
    assert len(turns) == 3
    bos = tokenizer.bos_token_id
    for (ctx, target), (prompt, gen) in zip(turns, texts):
        assert ctx[0] == bos and ctx.count(bos) == 1  # <bos> in the text, not added again
        assert target
        assert tokenizer.decode(ctx + target) == prompt + gen
    assert 106 in cf.stop_token_ids(tokenizer) and tokenizer.eos_token_id in cf.stop_token_ids(tokenizer)
