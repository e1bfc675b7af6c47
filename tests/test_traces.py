"""Trace readers (OpenAI chat JSONL, Claude Code logs) and the BFCL starter corpus."""
import json
from pathlib import Path

import pytest

from index.bfcl import bfcl_split, convert_schema, iter_bfcl_conversations, parse_call_string
from index.traces import ReadReport, iter_conversations, strip_ansi

FIXTURES = Path(__file__).parent / "fixtures"


def read(*paths):
    report = ReadReport()
    return list(iter_conversations(list(paths), report)), report


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {"path": "/tmp"}}}


def test_openai_jsonl_arguments_object_and_string_and_malformed_lines(tmp_path):
    good = {"messages": [{"role": "user", "content": "list"},
                         {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "c1", "content": "a b"},
                         {"role": "assistant", "content": "done"}],
            "tools": [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]}
    as_string = json.loads(json.dumps(good))
    as_string["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"path": "/tmp"}'
    f = write_jsonl(tmp_path / "t.jsonl", [
        good,
        "{not json",
        {"messages": [{"role": "wizard", "content": "x"}]},
        as_string,
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": "nope"},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
    ])
    convs, report = read(f)
    assert len(convs) == 2 and [c.line for c in convs] == [1, 4]
    for c in convs:
        args = c.messages[1]["tool_calls"][0]["function"]["arguments"]
        assert isinstance(args, str) and json.loads(args) == {"path": "/tmp"}
        assert c.tools[0]["function"]["name"] == "ls"
    assert [line for _, line, _ in report.skipped] == [2, 3, 5, 6, 7]
    summary = report.summary()
    assert f"{f}:3: message 0: unknown role 'wizard'" in summary
    assert "skipped 5" in summary and "t.jsonl:2: invalid JSON" in summary


def test_a_lone_surrogate_skips_its_line_in_either_format(tmp_path):
    """JSON may spell half a surrogate pair alone ("\\ud800"), which no tokenizer takes: the line is
    skipped and reported with where it is; whole pairs (an emoji) and the other lines are read."""
    chat = {"messages": [{"role": "user", "content": "hi \U0001f600"}, {"role": "assistant", "content": "ok"}]}
    lone = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "LONE"}]}).replace("LONE", "a \\udfff b")
    f = write_jsonl(tmp_path / "t.jsonl", [chat, lone, chat])
    convs, report = read(f)
    assert [c.line for c in convs] == [1, 3] and convs[0].messages[0]["content"] == "hi \U0001f600"
    assert f"{f}:2: a lone UTF-16 surrogate in messages[1].content" in report.summary()
    event = {"type": "user", "sessionId": "s", "uuid": "u1", "message": {"role": "user", "content": "LONE"}}
    reply = {"type": "assistant", "sessionId": "s", "uuid": "u2", "parentUuid": "u1",
             "message": {"role": "assistant", "content": [{"type": "text", "text": "fine"}]}}
    g = write_jsonl(tmp_path / "claude.jsonl", [json.dumps(event).replace("LONE", "\\ud800"),
                                                json.dumps(event).replace("LONE", "ok"), reply])
    convs, report = read(g)
    assert len(convs) == 1 and [line for _, line, _ in report.skipped] == [1]
    assert "a lone UTF-16 surrogate in message.content" in report.summary()


def test_encodings_utf8_with_a_mark_utf16_and_lines_that_are_not_utf8(tmp_path):
    """A UTF-8 byte-order mark is dropped and UTF-16 (by its mark) is read; a line in another
    encoding (Latin-1) is skipped and reported, never indexed with replacement characters."""
    conv = {"messages": [{"role": "user", "content": "Voil\u00e0: na\u00efve caf\u00e9"},
                         {"role": "assistant", "content": "oui"}]}
    line = json.dumps(conv, ensure_ascii=False) + "\n"
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + line.encode())
    (tmp_path / "utf16.jsonl").write_bytes(line.encode("utf-16"))
    for name in ("bom.jsonl", "utf16.jsonl"):
        convs, report = read(tmp_path / name)
        assert [c.messages[0]["content"] for c in convs] == ["Voil\u00e0: na\u00efve caf\u00e9"] and not report.skipped
    # characters str.splitlines breaks at, written unescaped (as the trace log writes them): one record
    separators = {"messages": [{"role": "user", "content": "a\u2028b\u2029c\x85d\x1ce"},
                               {"role": "assistant", "content": "ok"}]}
    g = tmp_path / "separators.jsonl"
    record = json.dumps(separators, ensure_ascii=False)
    g.write_text(record + "\r\n" + record + "\n")
    convs, report = read(g)
    assert [c.messages[0]["content"] for c in convs] == ["a\u2028b\u2029c\x85d\x1ce"] * 2 and not report.skipped
    plain = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(line.encode("latin-1") + (plain + "\n").encode())
    convs, report = read(f)
    assert [c.line for c in convs] == [2]
    assert f"{f}:1: not UTF-8 text" in report.summary()


def test_ansi_is_stripped_everywhere(tmp_path):
    red, osc = "\x1b[31;1m", "\x1b]0;title\x07"
    row = {"messages": [
        {"role": "user", "content": f"{red}hi\x1b[0m"},
        {"role": "assistant", "content": f"{osc}ok", "tool_calls": [
            {"id": "c", "function": {"name": "sh", "arguments": json.dumps({"cmd": f"{red}ls"})}}]},
        {"role": "tool", "tool_call_id": "c", "content": "\x1b[2Kfile\x1b(B"}]}
    convs, report = read(write_jsonl(tmp_path / "a.jsonl", [row]))
    text = json.dumps(convs[0].messages)
    assert "\\u001b" not in text and "\x1b" not in text
    assert convs[0].messages[0]["content"] == "hi"
    assert json.loads(convs[0].messages[1]["tool_calls"][0]["function"]["arguments"]) == {"cmd": "ls"}
    assert convs[0].messages[2]["content"] == "file"
    assert strip_ansi("a\x1b[38;5;196mb\x1b]8;;http://x\x1b\\c") == "abc"


def test_claude_code_session_becomes_one_conversation():
    convs, report = read(FIXTURES / "claude_code_short.jsonl")
    assert report.skipped == [] and len(convs) == 1
    msgs = convs[0].messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "user"]
    # five assistant events with one message.id (text, thinking, text, tool_use, tool_use) merge
    assistant = msgs[1]
    assert assistant["content"].startswith("Let me check")
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["Bash", "Glob"]
    assert json.loads(assistant["tool_calls"][1]["function"]["arguments"])["pattern"] == "mix.exs"
    call_ids = {c["id"] for c in assistant["tool_calls"]}
    assert {m["tool_call_id"] for m in msgs[2:4]} == call_ids
    assert [t["function"]["name"] for t in convs[0].tools] == ["Bash", "Glob"]
    assert convs[0].tools[0]["function"]["parameters"] == {"type": "object"}


def test_claude_code_merge_across_interleaved_tool_result():
    # Real log: thinking, text, tool_use(Glob), tool_result(Glob), tool_use(WebSearch), all one id
    convs, _ = read(FIXTURES / "claude_code_split_message.jsonl")
    msgs = convs[0].messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert [c["function"]["name"] for c in msgs[1]["tool_calls"]] == ["Glob", "WebSearch"]
    assert [m["name"] for m in msgs[2:]] == ["Glob", "WebSearch"]


def test_claude_code_sidechain_is_separate_and_bad_events_are_counted(tmp_path):
    def ev(kind, content, **kw):
        return {"type": kind, "sessionId": "s", "message": {"role": kind, "content": content, **kw.pop("m", {})}, **kw}

    rows = [
        ev("user", "go"),
        ev("assistant", [{"type": "tool_use", "id": "t1", "name": "Task", "input": {"p": 1}}], m={"id": "m1"}),
        ev("user", "sub task", isSidechain=True, agentId="a1"),
        ev("assistant", [{"type": "text", "text": "sub done"}], m={"id": "m2"}, isSidechain=True, agentId="a1"),
        ev("user", [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}]}]),
        ev("user", [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]),
        "garbage",
        {"type": "assistant", "sessionId": "s"},
        {"type": "summary", "summary": "ignored"},
        ev("assistant", [{"type": "text", "text": "all done"}], m={"id": "m3"}),
    ]
    convs, report = read(write_jsonl(tmp_path / "session.jsonl", rows))
    main, sub = convs
    assert [m["role"] for m in main.messages] == ["user", "assistant", "tool", "assistant"]
    assert main.messages[2] == {"role": "tool", "tool_call_id": "t1", "name": "Task", "content": "ok"}
    assert [m["content"] for m in sub.messages] == ["sub task", "sub done"] and sub.id.endswith("agent-a1")
    assert [(line, reason.split()[0]) for _, line, reason in report.skipped] == [
        (6, "tool_result"), (7, "invalid"), (8, "assistant")]


def _nested(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def test_hostile_nesting_and_ids_skip_their_line_and_keep_the_rest(tmp_path):
    """Each of these aborted a whole build with a traceback: a tool_use_id that is a list (unhashable),
    a line nested 100,000 deep (RecursionError in the JSON reader), tool-call arguments 900 deep
    (RecursionError stripping ANSI), and tool parameters 70 deep (the chat format refuses to render
    them). Each is now a skipped, reported line; deep arguments sent as a JSON string stay text."""
    good = {"messages": [{"role": "user", "content": "list"},
                         {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "c1", "content": "a b"},
                         {"role": "assistant", "content": "done"}]}
    deep_args = json.loads(json.dumps(good))
    deep_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"x": _nested(900)}
    deep_string_args = json.loads(json.dumps(good))
    deep_string_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"x": _nested(90)})
    deep_params = dict(good, tools=[{"type": "function", "function": {"name": "ls", "parameters": {
        "type": "object", "properties": {"p": _nested(70, {"type": "string"})}}}}])
    f = write_jsonl(tmp_path / "t.jsonl", [good, "[" * 100_000, good, deep_args, deep_params, deep_string_args])
    convs, report = read(f)
    assert len(convs) == 3   # good twice, and the one whose deep arguments stay a string
    assert json.loads(convs[2].messages[1]["tool_calls"][0]["function"]["arguments"]) == {"x": _nested(90)}
    reasons = {line: reason for _, line, reason in report.skipped}
    assert set(reasons) == {2, 4, 5}
    assert "deep" in reasons[2] and "deeper than" in reasons[4] and "parameters nested deeper" in reasons[5]

    def ev(kind, content, **kw):
        return {"type": kind, "sessionId": "s", "message": {"role": kind, "content": content, **kw}}
    rows = [ev("user", "go"), ev("assistant", [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}], id="m1"),
            ev("user", [{"type": "tool_result", "tool_use_id": ["t1"], "content": "x"}]),
            ev("user", [{"type": "tool_result", "tool_use_id": {"id": "t1"}, "content": "x"}]),
            ev("user", [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}])]
    convs, report = read(write_jsonl(tmp_path / "session.jsonl", rows))
    assert [m["role"] for m in convs[0].messages] == ["user", "assistant", "tool"]
    assert [(line, reason.split()[0]) for _, line, reason in report.skipped] == [(3, "tool_result"), (4, "tool_result")]


def test_directory_is_searched_recursively(tmp_path):
    (tmp_path / "deep" / "er").mkdir(parents=True)
    write_jsonl(tmp_path / "deep" / "er" / "x.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    (tmp_path / "notes.txt").write_text("not a trace")
    convs, report = read(tmp_path)
    assert report.files == 1 and len(convs) == 1


# ---------------------------------------------------------------- BFCL

def test_bfcl_single_turn_items():
    convs = {c.id: c for c in iter_bfcl_conversations(["simple_python", "live_multiple"])}
    c = convs["simple_python_0"]
    call = c.messages[-1]["tool_calls"][0]["function"]
    assert call["name"] == "calculate_triangle_area"
    assert json.loads(call["arguments"]) == {"base": 10, "height": 5, "unit": "units"}
    assert c.tools[0]["function"]["parameters"]["type"] == "object"
    # x: [4], y: [5], z: ["", 0] -> z is optional-absent
    assert json.loads(convs["simple_python_2"].messages[-1]["tool_calls"][0]["function"]["arguments"]) == {"x": 4, "y": 5}
    nested = json.loads(convs["live_multiple_0-0-0"].messages[-1]["tool_calls"][0]["function"]["arguments"])
    assert nested["new_preferences"]["size"] == "large"


def test_bfcl_multi_turn_item_and_counts():
    report = ReadReport()
    convs = list(iter_bfcl_conversations(["multi_turn_base"], report))
    assert report.by_format["bfcl/multi_turn_base"] == len(convs) == 200 and not report.skipped
    c = convs[0]
    assert [m["role"] for m in c.messages] == ["user", "assistant"] * 4
    names = [[t["function"]["name"] for t in m["tool_calls"]] for m in c.messages if m["role"] == "assistant"]
    assert names[0] == ["cd", "mkdir", "mv"]
    # "sort('final_report.pdf')": the positional argument is named from the tool's schema
    assert json.loads(c.messages[5]["tool_calls"][0]["function"]["arguments"]) == {"file_name": "final_report.pdf"}
    assert {"cd", "ls", "post_tweet"} <= {t["function"]["name"] for t in c.tools}


def test_bfcl_helpers_and_split():
    assert parse_call_string("a.b(1, k='v')", {"a.b": ["x", "k"]}) == ("a.b", {"x": 1, "k": "v"})
    with pytest.raises(ValueError):
        parse_call_string("f(1)", {})
    assert convert_schema({"type": "dict", "properties": {"x": {"type": "float"}, "y": {"type": "any"}}}) == \
        {"type": "object", "properties": {"x": {"type": "number"}, "y": {}}}
    convs = list(iter_bfcl_conversations(["simple_python"]))
    keep, hold = bfcl_split(convs, 0.25, seed=1)
    assert len(keep) + len(hold) == 400 and 60 < len(hold) < 140
    assert not {c.id for c in keep} & {c.id for c in hold}
    assert [c.id for c in bfcl_split(convs, 0.25, seed=1)[1]] == [c.id for c in hold]
