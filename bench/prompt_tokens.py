"""Tokenizing an agent's prompts turn after turn: whole, as before, against common.prompt_tokens,
which tokenizes only what follows the last added token a turn shares with the one before.

    python -m bench.prompt_tokens [--sessions 3] [--max-context 65536] [--max-turns 400] [--rounds 5]
                                  [--claude-samples DIR] [--out bench/results]

The sessions are real recorded conversations (bench.sessions, as bench.agent_sessions loads them):
the Claude Code sample transcripts, and held-out BFCL v4 multi-turn conversations chained into long
sessions (an agent working through several tasks in one conversation) up to `--max-context` tokens
or `--max-turns` turns; the `--sessions` longest chains and the longest Claude Code session. Each
assistant turn's request (the conversation before it, with its tools) is rendered by the bundled
model's chat format, and tokenized with the bundled tokenizer both ways, in the order a server sees
the turns (one PromptTokens a session, new each round); every round alternates which way goes
first. Reported per session: turns, prompt tokens first and last, the median over turns of each
turn's median over rounds (whole and reused), the same for the last turn, the whole session's
tokenizing time both ways with the ratio (median over rounds, and their range), and whether every
turn's ids were the same both ways (they must be).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.results import run_header, write_results
from bench.sessions import DEFAULT_CLAUDE_SAMPLES, ROOT


def session_prompts(args, tok) -> list[tuple[str, list[str]]]:
    """(session id, every turn's rendered prompt, in order) of the sessions measured, rendered by the
    chat format of `tok` (the bundled tokenizer)."""
    from bench.sessions import (BFCL_MULTI_TURN, assistant_positions, chain_conversations, last_prompt_tokens,
                                load_conversations)
    from common.chat_format import ChatFormat
    from server.protocol import parse_messages, parse_tools

    fmt = ChatFormat.for_tokenizer(tok)
    notes: list[str] = []
    recorded = load_conversations(args.claude_samples, list(BFCL_MULTI_TURN), notes)
    for n in notes:
        print("  note:", n, file=sys.stderr)
    chains = chain_conversations(recorded, lambda m, t: last_prompt_tokens(fmt, tok, m, t), args.max_context,
                                 args.max_turns)

    def prompts(c) -> list[str]:
        tools = parse_tools(c.tools)
        return [fmt.render_prompt(parse_messages(c.messages[:i]), tools, "auto")
                for i in assistant_positions(c.messages) if i > 0]

    def size(c) -> int:
        return last_prompt_tokens(fmt, tok, c.messages, c.tools)

    bfcl = sorted((c for c in chains if c.source == "bfcl"), key=size, reverse=True)[: args.sessions]
    claude = sorted((c for c in chains if c.source == "claude-code"), key=size, reverse=True)[:1]

    def name(c) -> str:  # a chain by its first conversation and how many follow it
        parts = c.id.split("+")
        return parts[0] + (f" + {len(parts) - 1} more" if len(parts) > 1 else "")

    return [(name(c), prompts(c)) for c in bfcl + claude]


def measure(prompts: list[str], rounds: int, tok=None) -> dict:
    """Each prompt tokenized both ways, `rounds` times (`tok`: the tokenizer, default the bundled one)."""
    from common.prompt_tokens import PromptTokens
    from common.tokenizer import load_tokenizer

    tok = tok or load_tokenizer()
    seconds = {False: [[0.0] * rounds for _ in prompts], True: [[0.0] * rounds for _ in prompts]}  # reused?
    lengths, same = [0] * len(prompts), [True] * len(prompts)
    for r in range(rounds):
        incremental = PromptTokens(tok)
        for i, text in enumerate(prompts):
            ids = {}
            for reuse in ((False, True) if r % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                got = incremental.encode(text) if reuse else tok.encode(text, add_special_tokens=False)
                seconds[reuse][i][r] = time.perf_counter() - t0
                ids[reuse] = list(got)
            lengths[i] = len(ids[False])
            same[i] = same[i] and ids[True] == ids[False]
    whole, reused = seconds[False], seconds[True]
    per_turn_whole = [statistics.median(t) * 1e3 for t in whole]
    per_turn_reused = [statistics.median(t) * 1e3 for t in reused]
    totals_whole = [sum(t[r] for t in whole) * 1e3 for r in range(rounds)]
    totals_reused = [sum(t[r] for t in reused) * 1e3 for r in range(rounds)]
    return {"turns": len(prompts), "first_tokens": lengths[0], "last_tokens": lengths[-1],
            "turn_ms_whole": statistics.median(per_turn_whole), "turn_ms_reused": statistics.median(per_turn_reused),
            "last_ms_whole": per_turn_whole[-1], "last_ms_reused": per_turn_reused[-1],
            "session_ms_whole": statistics.median(totals_whole), "session_ms_reused": statistics.median(totals_reused),
            "session_ms_whole_range": [min(totals_whole), max(totals_whole)],
            "session_ms_reused_range": [min(totals_reused), max(totals_reused)],
            "ratio": statistics.median(w / x for w, x in zip(totals_whole, totals_reused)),
            "identical_turns": sum(same)}


def markdown(r: dict) -> str:
    lines = ["# Tokenizing an agent's prompts turn after turn: whole against reusing the turn before\n",
             f"{r['when']}, {r['machine']}. Command: `{r['command']}`.\n",
             "Real recorded sessions (held-out BFCL v4 multi-turn conversations chained into long sessions, and "
             "the longest Claude Code sample), each assistant turn's request rendered by the bundled model's chat "
             "format and tokenized by its tokenizer: whole (`tokenizer.encode`, as the server did before), and by "
             "common.prompt_tokens (one a session, turn after turn, as the server sees them). "
             f"{r['rounds']} rounds, alternating which goes first; per turn the median over rounds.\n",
             "| session | turns | prompt tokens, first -> last | a turn, whole (ms, median) | a turn, reused | "
             "last turn, whole | last turn, reused | session, whole (ms) | session, reused (ms) | whole / reused | "
             "identical turns |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["sessions"].items():
        lines.append(f"| {name} | {s['turns']} | {s['first_tokens']:,} -> {s['last_tokens']:,} | "
                     f"{s['turn_ms_whole']:.2f} | {s['turn_ms_reused']:.2f} | {s['last_ms_whole']:.2f} | "
                     f"{s['last_ms_reused']:.2f} | {s['session_ms_whole']:.1f} "
                     f"({s['session_ms_whole_range'][0]:.1f}-{s['session_ms_whole_range'][1]:.1f}) | "
                     f"{s['session_ms_reused']:.1f} ({s['session_ms_reused_range'][0]:.1f}-"
                     f"{s['session_ms_reused_range'][1]:.1f}) | {s['ratio']:.1f}x | "
                     f"{s['identical_turns']}/{s['turns']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prompt_tokens", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=3, help="the longest chained BFCL sessions measured")
    p.add_argument("--max-context", type=int, default=65536, help="a chain closes at this many prompt tokens")
    p.add_argument("--max-turns", type=int, default=400, help="... or this many assistant turns")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--claude-samples", type=Path, default=DEFAULT_CLAUDE_SAMPLES,
                   help="directory of Claude Code transcripts (default <repo>/../shared/data/claude-code-samples)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    shown, given = ["python -m bench.prompt_tokens"], iter(argv if argv is not None else sys.argv[1:])
    for a in given:  # where it reads and writes (this machine's paths) left out
        if a in ("--out", "--claude-samples"):
            next(given, None)
        elif not a.startswith(("--out=", "--claude-samples=")):
            shown.append(a)
    results = {"command": " ".join(shown), "rounds": args.rounds, "sessions": {}}
    from common.tokenizer import load_tokenizer

    tok = load_tokenizer()
    for name, prompts in session_prompts(args, tok):
        if not prompts:
            continue
        print(f"  {name}: {len(prompts)} turns", file=sys.stderr)
        results["sessions"][name] = measure(prompts, args.rounds, tok)
    if not results["sessions"]:
        print("no sessions to measure (no Claude Code samples and no BFCL data)", file=sys.stderr)
        return 2
    md = markdown({**run_header(), **results})
    write_results(args.out, "prompt_tokens", results, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
