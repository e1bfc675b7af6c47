"""bench.agent_sessions without servers: sessions cut into turns, the caps, chaining, selection, the TTFT probes,
the stream reader, the summaries."""
import json
import shutil
from pathlib import Path

import pytest

from bench.agent_sessions import (CONTENDERS, identity, markdown, missing_flags, parse_args, percentile,
                                  prefix_cache_use, prefix_fields, prefix_metrics, read_stream, rotation, scrub,
                                  summarize, summarize_probes, thread_env, usage_numbers)
from bench.sessions import (Candidate, Probe, Session, Turn, assistant_positions, build_sessions, chain_conversations,
                            load_conversations, plan_probes, plan_turns, select_sessions, turn_token_counts,
                            variant_key)

FIXTURES = Path(__file__).parent / "fixtures"
CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}


def agent_conversation(n_turns: int) -> list[dict]:
    """system, user, then n_turns x (assistant call, tool result); a final assistant answer."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files"}]
    for k in range(n_turns - 1):
        msgs += [{"role": "assistant", "content": "", "tool_calls": [dict(CALL, id=f"c{k}")]},
                 {"role": "tool", "tool_call_id": f"c{k}", "content": f"file{k}"}]
    return msgs + [{"role": "assistant", "content": "done"}]


def test_turns_are_the_recorded_assistant_messages_and_send_everything_before_them():
    msgs = agent_conversation(4)
    counts = [(100, 20), (150, 80), (210, 5), (260, 300)]
    turns = plan_turns(msgs, counts, cap=64, max_turns=12, max_context=10_000)
    assert [t.index for t in turns] == assistant_positions(msgs) == [2, 4, 6, 8]
    assert [t.k for t in turns] == [0, 1, 2, 3]
    assert [t.prompt_tokens for t in turns] == [100, 150, 210, 260]
    # max_tokens = min(recorded reply length, cap)
    assert [t.max_tokens for t in turns] == [20, 64, 5, 64]
    assert [t.reply_tokens for t in turns] == [20, 80, 5, 300]
    s = Session("s", "test", msgs, [], turns)
    sent, _ = s.request(turns[1])
    assert sent == msgs[:4] and sent[-1]["role"] == "tool"  # the history, not the reply being asked for
    assert len(s.request(turns[-1])[0]) == len(msgs) - 1


def test_max_context_stops_the_session_and_max_turns_bounds_it():
    msgs = agent_conversation(5)
    counts = [(1000, 10), (1400, 10), (1600, 10), (1200, 10), (1800, 10)]
    turns = plan_turns(msgs, counts, cap=64, max_turns=12, max_context=1500)
    # stops at the first prompt over the limit; no later turn is taken even if it were shorter
    assert [t.prompt_tokens for t in turns] == [1000, 1400]
    assert len(plan_turns(msgs, counts, cap=64, max_turns=12, max_context=1600)) == 4
    assert len(plan_turns(msgs, counts, cap=64, max_turns=3, max_context=10_000)) == 3
    assert plan_turns(msgs, counts, cap=64, max_turns=12, max_context=999) == []


def test_edge_cases_of_the_cut():
    # an assistant message first has nothing to send before it; a zero-length reply still asks for 1 token
    msgs = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"},
            {"role": "assistant", "content": ""}]
    turns = plan_turns(msgs, [(5, 3), (9, 0)], cap=64, max_turns=12, max_context=100)
    assert [(t.index, t.max_tokens) for t in turns] == [(2, 1)]
    with pytest.raises(ValueError):
        plan_turns(msgs, [(5, 3)], cap=64, max_turns=12, max_context=100)


def test_build_and_select_sessions():
    def cand(cid, source, n):
        return Candidate(cid, source, agent_conversation(n), [])

    cands = [cand("multi_turn_base_7", "bfcl", 6), cand("multi_turn_miss_func_7", "bfcl", 7),
             cand("multi_turn_base_8", "bfcl", 5), cand("claude-code/a.jsonl", "claude-code", 4),
             cand("multi_turn_base_9", "bfcl", 2), cand("odd", "bfcl", 3)]
    counter = lambda c: [(1000 + 100 * j, 30) for j in range(len(assistant_positions(c.messages)))]
    notes = []
    sessions = build_sessions(cands + [cand("broken", "bfcl", 3)],
                              lambda c: None if c.id == "broken" else counter(c), 64, 12, 1550, notes)
    assert len(sessions) == 6 and any("broken" in n for n in notes)
    by_id = {s.id: s for s in sessions}
    assert len(by_id["multi_turn_miss_func_7"].turns) == 6 and by_id["multi_turn_miss_func_7"].recorded_turns == 7
    assert by_id["multi_turn_miss_func_7"].recorded_last_prompt == 1600
    picked = select_sessions(sessions, 10, min_turns=4)
    # Claude Code first, then the most turns (ties: the longer last prompt, then the id); one variant of
    # BFCL question 7 (both have 6 turns under the cut); the 2- and 3-turn ones are too short
    assert [s.id for s in picked] == ["claude-code/a.jsonl", "multi_turn_base_7", "multi_turn_base_8"]
    assert [s.id for s in select_sessions(sessions, 2, min_turns=1)] == ["claude-code/a.jsonl", "multi_turn_base_7"]
    longer = build_sessions(cands, counter, 64, 12, 10_000)
    assert [s.id for s in select_sessions(longer, 2, min_turns=4)][1] == "multi_turn_miss_func_7"
    assert variant_key("multi_turn_long_context_131") == variant_key("multi_turn_base_131")
    assert variant_key("simple_python_131") == "simple_python_131"


def test_claude_code_samples_are_read_with_ids_free_of_machine_paths(tmp_path):
    shutil.copy(FIXTURES / "claude_code_short.jsonl", tmp_path / "session.jsonl")
    notes = []
    cands = load_conversations(tmp_path, [], notes)
    assert [c.id for c in cands] == ["claude-code/session.jsonl"] and not notes
    assert cands[0].messages[1]["role"] == "assistant" and cands[0].tools
    load_conversations(tmp_path / "missing", [], notes)
    assert notes and "--claude-samples" in notes[0]


def _sse(obj) -> str:
    return "data: " + json.dumps(obj)


def test_stream_reader_times_the_first_generated_delta_and_assembles_calls():
    ticks = iter(range(100, 200))
    lines = [
        _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),  # not a token
        "",
        _sse({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "x", "type": "function", "function": {"name": "ls", "arguments": ""}}]}}]}),
        _sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}}]}),
        _sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]}),
        _sse({"choices": [{"index": 0, "delta": {"content": "ok"}}]}),
        _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "usage": None}),
        _sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}),
        "data: [DONE]",
        _sse({"choices": [{"index": 0, "delta": {"content": "after done"}}]}),
    ]
    r = read_stream(lines, clock=lambda: next(ticks))
    assert r["first_delta_at"] == 100  # the clock was read once, at the tool-call delta
    assert r["tool_calls"] == [{"name": "ls", "arguments": '{"a": 1}'}]
    assert r["content"] == "ok" and r["finish_reason"] == "tool_calls"
    assert r["usage"] == {"prompt_tokens": 9, "completion_tokens": 4}
    empty = read_stream([_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
                         "data: [DONE]"])
    assert empty["first_delta_at"] is None and empty["content"] == ""
    with pytest.raises(RuntimeError, match="boom"):
        read_stream([_sse({"error": {"message": "boom"}})])


def test_contender_flags_rotation_and_server_reports():
    assert CONTENDERS["baseline"] == ["--no-prefix-cache", "--no-draft"] and CONTENDERS["cache+draft"] == []
    help_text = "  --draft, --no-draft  draft and verify\n  --trace-log, --no-trace-log"
    assert missing_flags(["baseline", "cache"], help_text) == ["--no-prefix-cache"]
    assert missing_flags(["cache", "cache+draft"], help_text) == []
    assert missing_flags(["baseline"], help_text + "\n  --prefix-cache, --no-prefix-cache") == []
    names = list(CONTENDERS)
    orders = [rotation(names, s) for s in range(3)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert sorted(o[0] for o in orders) == sorted(names)  # each goes first once in three sessions
    metrics = ("# HELP sailfish_prefix_cache_bytes x\nsailfish_prefix_cache_bytes 1024\n"
               "sailfish_prefix_cache_peak_bytes 2048\nsailfish_requests_running 0\n")
    assert prefix_metrics(metrics) == {"sailfish_prefix_cache_bytes": 1024.0, "sailfish_prefix_cache_peak_bytes": 2048.0}
    assert prefix_fields({"status": "ok", "prefix_cache": {"bytes": 5}, "engine": {"prefix_hits": 2}}) == \
        {"prefix_cache": {"bytes": 5}, "engine.prefix_hits": 2}


def _rec(session, k, wall, content="x", cached=0):
    return {"session": session, "k": k, "wall_s": wall, "ttft_s": wall / 2, "error": None, "content": content,
            "tool_calls": [], "prompt_tokens": 100, "cached_tokens": cached, "sailfish_cached_tokens": None,
            "completion_tokens": 4, "drafted_tokens": 0, "accepted_tokens": 0, "prefill_s": 0.1,
            "decode_tokens_per_s": 10.0}


def test_summary_ratios_and_identity():
    turns = [Turn(k, 2 * k + 2, 100, 4, 4) for k in range(2)]
    sessions = [Session("a", "t", [], [], turns), Session("b", "t", [], [], turns)]
    records = {"baseline": [_rec("a", 0, 2.0), _rec("a", 1, 2.0), _rec("b", 0, 1.0), _rec("b", 1, 1.0)],
               "cache": [_rec("a", 0, 1.0, cached=50), _rec("a", 1, 1.0, cached=90),
                         _rec("b", 0, 1.0), _rec("b", 1, 1.0, content="y")]}
    summ = summarize(records, sessions)
    c = summ["contenders"]["cache"]
    assert summ["ratio_reference"] == "baseline" and summ["contenders"]["baseline"]["wall_ratio"] is None
    assert c["session_wall_s"] == {"a": 2.0, "b": 2.0}
    assert c["wall_ratio"]["min"] == 0.5 and c["wall_ratio"]["max"] == 1.0  # a: 2/4, b: 2/2
    assert c["cached_tokens"] == 140 and c["cached_share"] == 140 / 400
    ident = identity(records)
    assert ident["mismatches"] == 1 and ident["differs_from_reference"]["cache"] == ["b turn 1"]
    assert percentile([1, 2, 3, 4], 0.5) == 2.5 and percentile([3], 0.9) == 3 and percentile([], 0.5) is None


@pytest.mark.slow
def test_token_counts_are_the_prompt_the_server_renders():
    from common.chat_format import ChatFormat
    from common.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    fmt = ChatFormat.for_tokenizer(tok)
    msgs = agent_conversation(3)
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    counts = turn_token_counts(fmt, tok, msgs, tools)
    assert len(counts) == 3
    for i, (prompt, reply) in zip(assistant_positions(msgs), counts):
        # what serving.prepare_chat encodes for messages[:i]
        assert prompt == len(tok.encode(fmt.render_prompt(msgs[:i], tools), add_special_tokens=False))
        assert reply > 0


@pytest.mark.parametrize("interleave", ["session", "turn"])
def test_replay_sends_every_turn_to_every_contender_in_rotating_order(monkeypatch, interleave):
    import bench.agent_sessions as bench

    sent = []

    def fake_send(client, session, turn):
        sent.append((str(client.base_url).split(":")[-1].strip("/"), session.id, turn.k))
        return {"session": session.id, "k": turn.k, "error": None, "wall_s": 1.0}

    monkeypatch.setattr(bench, "send_turn", fake_send)
    servers = {name: bench.Server(name, [], None, f"http://127.0.0.1:{port}", Path("x"), 0.0)
               for name, port in (("a", 1), ("b", 2), ("c", 3))}
    turns = [Turn(k, 2 * k + 2, 10, 4, 4) for k in range(2)]
    sessions = [Session("s0", "t", [], [], turns), Session("s1", "t", [], [], turns)]
    records = bench.replay(servers, sessions, interleave, log=lambda m: None)
    measured = sent[2 * len(servers):]  # after two warm-up requests per server
    assert sorted(measured) == sorted((p, s.id, t.k) for p in "123" for s in sessions for t in turns)
    for name in servers:  # every contender's records in session/turn order, aligned for the identity check
        assert [(r["session"], r["k"]) for r in records[name]] == [("s0", 0), ("s0", 1), ("s1", 0), ("s1", 1)]
    if interleave == "session":
        assert [m[0] for m in measured] == list("112233" "223311")
    else:
        assert [m[0] for m in measured] == list("123" "231" "312" "123")


# ---------------------------------------------------------------- chaining BFCL conversations


def bfcl_conversation(qid: str, n_turns: int) -> list[dict]:
    """BFCL multi-turn shape: user, assistant calls, user, ... (no system message, no tool results)."""
    msgs = []
    for t in range(n_turns):
        msgs += [{"role": "user", "content": f"{qid} task {t}"},
                 {"role": "assistant", "content": "", "tool_calls": [dict(CALL, id=f"call_{t}_0")]}]
    return msgs


TOOLS_A = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
TOOLS_B = [{"type": "function", "function": {"name": "cd", "parameters": {"type": "object"}}}]


def _bfcl(qid, n, tools=TOOLS_A):
    return Candidate(qid, "bfcl", bfcl_conversation(qid, n), tools)


def _length(messages, tools):
    """A stand-in tokenizer: 1000 tokens of tool declarations, 100 per message before the last assistant one."""
    return 1000 + 100 * assistant_positions(messages)[-1]


def test_chains_append_conversations_with_the_same_tools_one_variant_per_question():
    cands = [_bfcl("multi_turn_base_3", 3), _bfcl("multi_turn_long_context_3", 3),  # same question: one is dropped
             _bfcl("multi_turn_base_1", 2), _bfcl("multi_turn_miss_param_2", 4),
             _bfcl("multi_turn_base_9", 2, TOOLS_B),                      # other tools: never joined with the rest
             _bfcl("multi_turn_miss_func_1", 3, TOOLS_B),                 # question 1 already used in the larger group
             Candidate("claude-code/x.jsonl", "claude-code", agent_conversation(3), [])]
    out = chain_conversations(cands, _length, max_context=100_000, max_turns=100)
    by_id = {c.id: c for c in out}
    assert "claude-code/x.jsonl" in by_id and by_id["claude-code/x.jsonl"].parts == []  # passed through as is
    chain = by_id["multi_turn_base_1+multi_turn_miss_param_2+multi_turn_base_3"]  # by question number
    assert chain.parts == ["multi_turn_base_1", "multi_turn_miss_param_2", "multi_turn_base_3"]
    # B's messages follow A's unchanged, under the one tool list
    assert chain.messages == cands[2].messages + cands[3].messages + cands[0].messages
    assert chain.tools == TOOLS_A and chain.source == "bfcl"
    assert by_id["multi_turn_base_9"].messages == cands[4].messages  # alone in its group: a plain conversation
    used = [variant_key(p) for c in out for p in (c.parts or [c.id]) if c.source == "bfcl"]
    assert len(used) == len(set(used)) == 4  # questions 1, 2, 3, 9: each once over all chains
    assert not any("long_context_3" in c.id or "miss_func_1" in c.id for c in out)


def test_a_chain_closes_at_the_context_or_turn_limit_and_the_next_one_starts():
    cands = [_bfcl(f"multi_turn_base_{q}", 3) for q in range(1, 6)]
    # each conversation has 6 messages: the chain's last prompt is 1000 + 100 * (last assistant position)
    out = chain_conversations(cands, _length, max_context=2600, max_turns=100)
    # 1 part: 1000 + 100*5 = 1500; 2 parts: 2100; 3 parts: 2700 >= 2600, closed; then 4+5 (2100) is what is left
    assert [len(c.parts or [c.id]) for c in out] == [3, 2]
    out = chain_conversations(cands, _length, max_context=100_000, max_turns=6)
    assert [c.parts for c in out] == [["multi_turn_base_1", "multi_turn_base_2"],
                                      ["multi_turn_base_3", "multi_turn_base_4"], []]
    assert out[-1].id == "multi_turn_base_5"
    # the chained session's turns are every assistant message of every part, in order
    counts = lambda c: [(_length(c.messages[: i + 1], c.tools), 20) for i in assistant_positions(c.messages)]
    s = build_sessions(out[:1], counts, cap=64, max_turns=12, max_context=100_000)[0]
    assert [t.index for t in s.turns] == [1, 3, 5, 7, 9, 11] and s.parts == out[0].parts
    assert s.request(s.turns[3])[0][-1]["content"] == "multi_turn_base_2 task 0"  # B's first request carries A
    assert s.questions() == {"bfcl-multi-turn-question-1", "bfcl-multi-turn-question-2"}


def _session(sid, prompts, source="bfcl", parts=None):
    turns = [Turn(k, 2 * k + 1, p, 20, 20) for k, p in enumerate(prompts)]
    return Session(sid, source, [], [], turns, len(turns), prompts[-1] if prompts else 0, parts or [sid])


def test_selection_keeps_the_long_ones_and_claude_code_transcripts_apart():
    long_a = _session("multi_turn_base_1+multi_turn_base_2", [4000 + 100 * k for k in range(12)],
                      parts=["multi_turn_base_1", "multi_turn_base_2"])
    # shares question 2 with long_a: never selected with it, though it is longer
    long_b = _session("multi_turn_miss_func_2+multi_turn_base_3", [4500 + 100 * k for k in range(12)],
                      parts=["multi_turn_miss_func_2", "multi_turn_base_3"])
    long_c = _session("multi_turn_base_4+multi_turn_base_5", [3000 + 100 * k for k in range(11)],
                      parts=["multi_turn_base_4", "multi_turn_base_5"])
    short_bfcl = _session("multi_turn_base_6", [3000, 3100, 3200])
    cc4 = _session("claude-code/a.jsonl", [200, 800, 1200, 1600], "claude-code")
    cc2 = _session("claude-code/b.jsonl", [2800, 5400], "claude-code")
    cc1 = _session("claude-code/c.jsonl", [90], "claude-code")
    sessions = [long_a, long_b, long_c, short_bfcl, cc4, cc2, cc1]
    picked = select_sessions(sessions, 3, min_turns=10, claude_extra=2)
    assert [s.id for s in picked] == [long_b.id, long_c.id, cc4.id, cc2.id]  # 1-turn transcript: nothing to compare
    assert [s.id for s in select_sessions(sessions, 2, min_turns=10)] == [long_b.id, long_c.id]
    assert [s.id for s in select_sessions(sessions, 5, min_turns=10, claude_extra=1)][-1] == cc4.id


def test_probes_pick_a_turn_adding_about_200_tokens_to_about_4000_from_sessions_not_replayed():
    replayed = _session("multi_turn_base_1+multi_turn_base_2", [3990, 4190, 4390], parts=["multi_turn_base_1",
                                                                                          "multi_turn_base_2"])
    sibling = _session("multi_turn_miss_func_2", [4000, 4200])            # shares question 2 with a replayed session
    good = _session("multi_turn_base_3+multi_turn_base_4", [3000, 3500, 4100, 4310, 4420],
                    parts=["multi_turn_base_3", "multi_turn_base_4"])
    far = _session("multi_turn_base_5", [4550, 4700])                    # 4550 is within 15% of 4000, +150
    too_big_step = _session("multi_turn_base_6", [4000, 4700])           # adds 700: not a ~200-token turn
    too_short = _session("multi_turn_base_7", [2000, 2200])
    probes = plan_probes([replayed, sibling, good, far, too_big_step, too_short], [replayed], 5)
    assert [p.session.id for p in probes] == [good.id, far.id]
    p = probes[0]
    assert (p.cached.k, p.turn.k, p.cached.prompt_tokens, p.added_tokens) == (2, 3, 4100, 210)
    assert plan_probes([good, far], [], 1)[0].session is good
    assert plan_probes([good], [], 3, prompt=2500) == []


def test_usage_numbers_give_server_side_ttft():
    u = {"prompt_tokens": 4300, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4100},
         "sailfish": {"cached_tokens": 4100, "queue_s": 0.25, "prefill_s": 0.5, "decode_tokens_per_s": 12.0}}
    n = usage_numbers(u)
    assert n["server_ttft_s"] == 0.75 and n["cached_tokens"] == 4100 and n["queue_s"] == 0.25
    assert usage_numbers({"prompt_tokens": 3})["server_ttft_s"] is None
    assert usage_numbers(None)["cached_tokens"] == 0


def _probe_rec(j, phase, ttft, prompt=4300, cached=0, content="x"):
    return {"session": f"s{j}", "k": 1, "probe": j, "phase": phase, "server_ttft_s": ttft, "ttft_s": 2 * ttft,
            "prefill_s": ttft, "queue_s": 0.0, "prompt_tokens": prompt, "cached_tokens": cached, "error": None,
            "content": content, "tool_calls": []}


def test_probe_ratios_are_against_the_fresh_contender():
    probes = [Probe(_session(f"s{j}", [4100, 4300]), Turn(0, 1, 4100, 20, 20), Turn(1, 3, 4300, 20, 20))
              for j in range(3)]
    flags = {"baseline": ["--no-prefix-cache", "--no-draft"], "cache": ["--no-draft"]}
    records = {"baseline": [_probe_rec(j, "measured", 10.0) for j in range(3)],
               "cache": [r for j, t in enumerate((0.5, 1.0, 3.0))
                         for r in (_probe_rec(j, "cached", 9.0), _probe_rec(j, "measured", t, cached=4100))]}
    summ = summarize_probes(records, probes, flags)
    assert summ["fresh"] == "baseline"
    cells = [row["contenders"]["cache"] for row in summ["probes"]]
    assert [c["ratio"] for c in cells] == [0.05, 0.1, 0.3]  # the "cached" request is not the measured one
    assert cells[0]["added_tokens"] == 200 and summ["probes"][0]["recorded_added_tokens"] == 200
    assert summ["contenders"]["cache"]["ratio"]["median"] == 0.1 and summ["contenders"]["cache"]["meets_bar"]
    assert "baseline" not in summ["contenders"]
    records["cache"][3]["server_ttft_s"] = records["cache"][5]["server_ttft_s"] = 9.0
    assert not summarize_probes(records, probes, flags)["contenders"]["cache"]["meets_bar"]  # median 0.9 now


def test_groups_speedups_and_the_report():
    turns12 = [Turn(k, 2 * k + 1, 4000 + 100 * k, 4, 4) for k in range(12)]
    sessions = [Session("long", "bfcl", [], [], turns12, 12, 5100, ["multi_turn_base_1", "multi_turn_base_2"]),
                Session("claude-code/a.jsonl", "claude-code", [], [], turns12[:2], 2, 4100)]
    records = {"baseline": [_rec(s.id, t.k, 10.0) for s in sessions for t in s.turns],
               "cache+draft": [_rec(s.id, t.k, 1.0 if s.id == "long" else 5.0) for s in sessions for t in s.turns]}
    for recs in records.values():
        for r in recs:
            r["server_ttft_s"] = r["wall_s"] / 4
    summ = summarize(records, sessions, min_turns=10)
    assert summ["groups"] == {"long (>= 10 turns)": ["long"], "claude-code": ["claude-code/a.jsonl"]}
    g = summ["contenders"]["cache+draft"]["groups"]
    assert g["long (>= 10 turns)"]["speedup"]["median"] == 10.0 and g["claude-code"]["speedup"]["median"] == 2.0
    assert summ["contenders"]["cache+draft"]["server_ttft_s"]["median"] == 0.25
    result = {"config": {"max_tokens": 64, "max_turns": 12, "max_context": 6000, "min_turns": 10, "interleave": "session",
                         "model": None, "index": None, "probe_prompt": 4000, "probe_added": 200},
              "summary": summ, "identical": identity(records), "when": "now", "machine": "m", "command": "c",
              "seconds": 60, "notes": [], "probes": None, "probe_identical": None,
              "sessions": [{"id": s.id, "source": s.source, "parts": s.parts, "recorded_turns": s.recorded_turns,
                            "turns": [{"prompt_tokens": t.prompt_tokens, "max_tokens": t.max_tokens} for t in s.turns]}
                           for s in sessions],
              "servers": {n: {"flags": CONTENDERS[n], "startup_s": 5.0, "peak_rss_bytes": 2**30,
                              "health": {"prefix_cache": None if n == "baseline" else
                                         {"budget_bytes": 2**31, "peak_bytes": 2**29, "bytes": 2**28, "entries": 3}}}
                          for n in records}}
    md = markdown(result)
    assert "long (>= 10 turns) sessions (1): median 10.00x (min 10.00x, max 10.00x) - meets the 5x bar" in md
    assert "claude-code sessions (1): median 2.00x" in md and "| 512 MiB / 2,048 MiB |" in md
    assert str(Path.home()) not in md and str(FIXTURES.parent.parent) not in md
    assert prefix_cache_use(result["servers"]["baseline"]) is None


def test_defaults_threads_and_scrubbed_paths():
    args = parse_args([])
    assert (args.min_turns, args.max_turns, args.sessions, args.probes) == (10, 10, 3, 4)  # the bar: 10 turns
    assert (args.probe_prompt, args.probe_added) == (4000, 200)
    assert parse_args(["--quick"]).min_turns == 3 and parse_args(["--threads", "0"]).threads == 0
    assert thread_env(0) == {} and thread_env(1) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    home = str(Path.home())
    out = scrub({"drafting": f"index {home}/.local/share/sailfish/index: 4277 turns", "n": 3,
                 "log": [f"{home}/x", "plain"]}, [(home, "~")])
    assert out == {"drafting": "index ~/.local/share/sailfish/index: 4277 turns", "n": 3, "log": ["~/x", "plain"]}
