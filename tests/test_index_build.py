"""`python -m index build` end to end with the bundled tokenizer: formats, bad lines, incremental."""
import json
import shutil
from pathlib import Path

import pytest

from index.__main__ import main
from ngram.index_file import load_index

FIXTURES = Path(__file__).parent / "fixtures"
pytestmark = pytest.mark.slow


def _openai_lines():
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    good = {"messages": [
        {"role": "user", "content": "show \x1b[31mmain.py\x1b[0m"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "main.py"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
        {"role": "assistant", "content": "It prints 1."},
    ], "tools": tools}
    return [json.dumps(good), "{not json", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), json.dumps(good)]


def test_build_counts_bad_lines_and_indexes_both_formats(tmp_path, capsys):
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "chat.jsonl").write_text("\n".join(_openai_lines()) + "\n")
    shutil.copy(FIXTURES / "claude_code_short.jsonl", traces / "session.jsonl")
    assert main(["build", "--traces", str(traces), "--out", str(tmp_path / "idx"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "chat.jsonl:2" in out and "chat.jsonl:3" in out  # file and line of each skipped line
    assert "skipped" in out.lower()
    idx = load_index(tmp_path / "idx")
    assert idx.meta["stats"]["turns"] >= 4
    assert idx.meta["conversations"] >= 3
    corpus_text = idx.corpus.tobytes()
    assert corpus_text  # tokens were indexed


def test_a_conversation_the_format_cannot_render_is_reported_not_fatal(tmp_path, capsys, monkeypatch):
    """One conversation the chat format refuses to render (a template's own refusal, or a value the
    reader let through) used to abort the whole build: it is now a skipped, reported line, on the
    fast path and on the per-turn path alike."""
    from common.chat_format import ChatFormat

    real = ChatFormat.render_with_spans

    def refuse_one(self, messages, tools):
        if "REFUSE" in json.dumps(messages):
            raise ValueError("this template cannot render it")
        return real(self, messages, tools)
    monkeypatch.setattr(ChatFormat, "render_with_spans", refuse_one)
    refused = json.loads(_openai_lines()[0])
    refused["messages"][0]["content"] = "REFUSE this"
    traces = tmp_path / "chat.jsonl"
    traces.write_text("\n".join([_openai_lines()[0], json.dumps(refused), _openai_lines()[0]]) + "\n")
    assert main(["build", "--traces", str(traces), "--out", str(tmp_path / "idx"), "--quiet"]) == 0
    assert "chat.jsonl:2: cannot be rendered (ValueError: this template cannot render it)" in capsys.readouterr().out
    assert load_index(tmp_path / "idx").meta["stats"]["turns"] == 4   # two of the three conversations


def test_no_usable_turns_is_an_error_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["build", "--traces", str(bad), "--out", str(tmp_path / "idx"), "--quiet"]) == 2
    assert "no usable assistant turns" in capsys.readouterr().err
    assert not (tmp_path / "idx" / "current").exists()


def test_rebuild_reuses_unchanged_sources(tmp_path, capsys):
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "a.jsonl").write_text(_openai_lines()[0] + "\n")
    out = tmp_path / "idx"
    assert main(["build", "--traces", str(traces), "--out", str(out), "--quiet"]) == 0
    first = load_index(out).meta["stats"]["tokens"]
    (traces / "b.jsonl").write_text(_openai_lines()[0] + "\n")
    capsys.readouterr()
    assert main(["build", "--traces", str(traces), "--out", str(out), "--quiet"]) == 0
    assert "sources read 1, reused from the previous index 1" in capsys.readouterr().out
    assert load_index(out).meta["stats"]["tokens"] == 2 * first


def test_a_source_that_could_not_be_read_is_read_again_next_build(tmp_path, capsys, monkeypatch):
    """A file unreadable at one build (permissions) is not kept as read: once readable, the next
    incremental build reads it (its size and time did not change). A link to nothing and a
    directory named like a trace file are passed over, the link reported."""
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "a.jsonl").write_text(_openai_lines()[0] + "\n")
    (traces / "b.jsonl").write_text(_openai_lines()[0] + "\n")
    (traces / "dead.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    (traces / "folder.jsonl").mkdir()
    (traces / "folder.jsonl" / "c.jsonl").write_text(_openai_lines()[0] + "\n")
    real = Path.read_bytes

    def locked(path):
        if path.name == "b.jsonl":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    out = tmp_path / "idx"
    monkeypatch.setattr(Path, "read_bytes", locked)
    assert main(["build", "--traces", str(traces), "--out", str(out), "--quiet"]) == 0
    first = capsys.readouterr().out
    assert "b.jsonl:0: unreadable" in first
    assert "dead.jsonl:0: a link to nothing" in first
    assert load_index(out).meta["conversations"] == 2  # a and folder.jsonl/c, each once
    monkeypatch.setattr(Path, "read_bytes", real)
    assert main(["build", "--traces", str(traces), "--out", str(out), "--quiet"]) == 0
    assert "sources read 1, reused from the previous index 2" in capsys.readouterr().out
    assert load_index(out).meta["conversations"] == 3


def test_outputs_that_cannot_be_written_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """An --out that is a file (or under one) ends `index build` / `index distill` with status 2 and
    the reason before anything is read, tokenized or generated; nonsense key lengths are usage errors."""
    import index.build

    monkeypatch.setattr(index.build, "load_tokenizer", lambda *a: pytest.fail("work began"))
    traces = tmp_path / "t.jsonl"
    traces.write_text(_openai_lines()[0] + "\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out, says in ((a_file, "exists and is not a directory"), (a_file / "sub", "is not a directory")):
        assert main(["build", "--traces", str(traces), "--out", str(out), "--quiet"]) == 2
        assert says in capsys.readouterr().err
    assert main(["distill", "--traces", str(traces), "--out", str(tmp_path)]) == 2
    assert "exists and is a directory" in capsys.readouterr().err
    for flag, value in (("--key-tokens", "0"), ("--anchor-tokens", "-1")):
        with pytest.raises(SystemExit) as usage:
            main(["build", "--traces", str(traces), flag, value])
        assert usage.value.code == 2


def test_default_sources_say_how_many_trace_files_they_hold(tmp_path, monkeypatch):
    from common.paths import claude_code_dir, describe_source

    monkeypatch.setenv("HOME", str(tmp_path))
    claude = claude_code_dir()
    claude.mkdir(parents=True)
    assert "no Claude Code sessions yet" in describe_source(claude)
    (claude / "project").mkdir()
    (claude / "project" / "one.jsonl").write_text("{}\n")
    (claude / "project" / "two.jsonl").write_text("{}\n")
    assert describe_source(claude).endswith("(2 Claude Code sessions)")
