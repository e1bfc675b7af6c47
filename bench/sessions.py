"""Agent sessions for bench.agent_sessions: recorded conversations cut into the turns a client replays.

Contract:
- A session is one conversation (OpenAI-style `messages` + `tools`). Its turns are the points where
  it has an assistant message at position i > 0: the client sends `messages[:i]` with the tools,
  greedy, and asks for `max_tokens = min(recorded reply tokens, cap)` (at least 1). `plan_turns`
  makes them from per-assistant-message token counts (prompt tokens before the message, tokens of
  the message as generated, end marker included); the session stops after `max_turns` turns, or at
  the first turn whose prompt has more than `max_context` tokens (prompts only grow, so no later
  turn would fit either).
- `turn_token_counts(fmt, tok, messages, tools)` gives those counts with a tokenizer and
  `common.chat_format.ChatFormat`: the prompt exactly as the server renders and encodes it, the reply
  as `common.tokenizer.conversation_turns` cuts it from the whole conversation.
- `load_conversations(claude_dir, bfcl_categories, notes)` reads the Claude Code sample transcripts
  (`index.traces.iter_conversations`) and the HELD-OUT part of BFCL v4 (`bfcl_split` with
  common.paths' constants: the default index is built from the other part).
- `chain_conversations(candidates, last_prompt, max_context, max_turns)`: an agent working through
  several tasks in one conversation. No recorded BFCL multi-turn conversation is long enough for the
  bar (at most 7 assistant turns, 0.1k-0.8k tokens past the tool declarations), so held-out
  conversations that offer the SAME tool list (`tools` identical, which for BFCL means the same
  involved classes and the same excluded functions) are appended one after another: conversation
  B's messages follow A's unchanged, under the one tool list (BFCL has no system message). Groups are
  taken largest first, members by question number then category; a chain is closed once its last
  recorded prompt (`last_prompt(messages, tools)`, tokens) reaches `max_context` or it has
  `max_turns` assistant turns, and a new one starts with the group's next conversation. Each BFCL
  question number is used ONCE over all chains (one variant of the four multi-turn categories).
  Other candidates (Claude Code transcripts) pass through unchanged: they are real single sessions.
- `select_sessions(sessions, n, min_turns, claude_extra=0)`: `n` sessions with at least `min_turns`
  turns (Claude Code transcripts first, then the most turns, then the longest last prompt), no two
  sharing a BFCL question number; then up to `claude_extra` Claude Code transcripts that have fewer
  turns (at least 2), reported apart.
- `plan_probes(sessions, exclude, n, prompt, added, ...)`: the TTFT bar's turns, "a turn that adds
  ~`added` tokens to a cached ~`prompt`-token conversation", from sessions that are NOT replayed
  (so the measured turn's own prompt was never sent before): per session the pair of consecutive
  turns (a, b) with prompt(a) near `prompt` and prompt(b) - prompt(a) near `added` (relative distance
  summed, both within the given windows), best first, at most one per session.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CLAUDE_SAMPLES = ROOT.parent / "shared" / "data" / "claude-code-samples"
BFCL_MULTI_TURN = ("multi_turn_base", "multi_turn_long_context", "multi_turn_miss_func", "multi_turn_miss_param")
_BFCL_VARIANT = re.compile(r"multi_turn_([a-z_]+?)_(\d+)")
CHAIN_SEP = "+"


@dataclass(frozen=True)
class Turn:
    k: int              # turn number in the session, from 0
    index: int          # position of the recorded assistant message; the request sends messages[:index]
    prompt_tokens: int  # the prompt's length by the client's tokenizer
    reply_tokens: int   # the recorded reply's length, end marker included
    max_tokens: int     # what the request asks for: min(reply_tokens, cap), at least 1


@dataclass
class Session:
    id: str
    source: str                  # "claude-code" or "bfcl"
    messages: list[dict]
    tools: list[dict]
    turns: list[Turn]
    recorded_turns: int = 0      # assistant turns in the whole recording, before any cut
    recorded_last_prompt: int = 0  # prompt tokens before the recording's last assistant turn
    parts: list[str] = field(default_factory=list)  # the recorded conversations it is made of, in order

    def request(self, turn: Turn) -> tuple[list[dict], list[dict]]:
        return self.messages[: turn.index], self.tools

    def questions(self) -> set[str]:
        return {variant_key(p) for p in (self.parts or [self.id])}


@dataclass
class Candidate:
    """A conversation before it is cut into turns."""
    id: str
    source: str
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)  # chained: the conversations, in order (else [id])


@dataclass(frozen=True)
class Probe:
    """The TTFT bar's measurement: `cached` is sent first (the conversation so far, now in the cache),
    then `turn`, timed, which adds prompt(turn) - prompt(cached) tokens to it."""
    session: Session
    cached: Turn
    turn: Turn

    @property
    def added_tokens(self) -> int:
        return self.turn.prompt_tokens - self.cached.prompt_tokens


def assistant_positions(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant"]


def reply_cap(reply_tokens: int, cap: int) -> int:
    return max(1, min(reply_tokens, cap))


def plan_turns(messages: list[dict], counts: list[tuple[int, int]], cap: int, max_turns: int,
               max_context: int) -> list[Turn]:
    """The turns a client replays; `counts[j]` = (prompt tokens, reply tokens) of the j-th assistant message."""
    positions = assistant_positions(messages)
    if len(counts) != len(positions):
        raise ValueError(f"{len(counts)} token counts for {len(positions)} assistant messages")
    turns: list[Turn] = []
    for index, (prompt, reply) in zip(positions, counts):
        if index == 0:
            continue  # nothing precedes it: there is no request to send
        if len(turns) >= max_turns or prompt > max_context:
            break
        turns.append(Turn(len(turns), index, prompt, reply, reply_cap(reply, cap)))
    return turns


def turn_token_counts(fmt, tok, messages: list[dict], tools: list[dict]) -> list[tuple[int, int]] | None:
    """(prompt tokens, reply tokens) per assistant message; None when the format cannot cut every turn."""
    from common.tokenizer import conversation_turns

    positions = assistant_positions(messages)
    turns = conversation_turns(fmt, tok, messages, tools)
    if len(turns) != len(positions):
        return None  # a chat template that does not render some turn as a prefix of the next
    # The prompt as the server encodes it (serving.prepare_chat): cutting the whole conversation's
    # tokenization at the turn's offset can be a token off at the cut.
    return [(len(tok.encode(fmt.render_prompt(messages[:i], tools), add_special_tokens=False)) if i else len(ctx),
             len(target)) for i, (ctx, target) in zip(positions, turns)]


def last_prompt_tokens(fmt, tok, messages: list[dict], tools: list[dict]) -> int:
    """Tokens of the prompt before the last assistant message (the whole conversation when it has none)."""
    positions = assistant_positions(messages)
    cut = positions[-1] if positions else len(messages)
    return len(tok.encode(fmt.render_prompt(messages[:cut], tools), add_special_tokens=False))


def build_sessions(candidates: Iterable[Candidate], counter: Callable[[Candidate], list[tuple[int, int]] | None],
                   cap: int, max_turns: int, max_context: int, notes: list[str] | None = None) -> list[Session]:
    out = []
    for c in candidates:
        counts = counter(c)
        if counts is None:
            if notes is not None:
                notes.append(f"{c.id}: the chat format does not cut every assistant turn; skipped")
            continue
        turns = plan_turns(c.messages, counts, cap, max_turns, max_context)
        recorded = [p for i, (p, _) in zip(assistant_positions(c.messages), counts) if i > 0]
        out.append(Session(c.id, c.source, c.messages, c.tools, turns, len(recorded),
                           recorded[-1] if recorded else 0, list(c.parts) or [c.id]))
    return out


def variant_key(session_id: str) -> str:
    """BFCL multi-turn categories repeat the same numbered question: one key for all its variants."""
    m = _BFCL_VARIANT.fullmatch(session_id)
    return f"bfcl-multi-turn-question-{m.group(2)}" if m else session_id


def _bfcl_order(c: Candidate) -> tuple:
    """Question number, then the category's place in BFCL_MULTI_TURN (base first), then the id."""
    m = _BFCL_VARIANT.fullmatch(c.id)
    if not m:
        return (1 << 30, len(BFCL_MULTI_TURN), c.id)
    cat = f"multi_turn_{m.group(1)}"
    return (int(m.group(2)), BFCL_MULTI_TURN.index(cat) if cat in BFCL_MULTI_TURN else len(BFCL_MULTI_TURN), c.id)


def tool_set_key(tools: list[dict]) -> str:
    return json.dumps(tools, sort_keys=True, ensure_ascii=False)


def _joined(chain: list[Candidate]) -> Candidate:
    if len(chain) == 1:
        return chain[0]
    messages = [m for c in chain for m in c.messages]
    return Candidate(CHAIN_SEP.join(c.id for c in chain), chain[0].source, messages, chain[0].tools,
                     [c.id for c in chain])


def chain_conversations(candidates: Iterable[Candidate], last_prompt: Callable[[list[dict], list[dict]], int],
                        max_context: int, max_turns: int, source: str = "bfcl") -> list[Candidate]:
    """Candidates of `source` chained into long sessions (see the module's contract); others unchanged."""
    cands = list(candidates)
    others = [c for c in cands if c.source != source]
    groups: dict[str, list[Candidate]] = {}
    for c in cands:
        if c.source == source:
            groups.setdefault(tool_set_key(c.tools), []).append(c)
    ordered = sorted(groups.values(), key=lambda g: (-len(g), min(_bfcl_order(c) for c in g)))
    used: set[str] = set()
    chains: list[Candidate] = []
    for group in ordered:
        chain: list[Candidate] = []
        for c in sorted(group, key=_bfcl_order):
            q = variant_key(c.id)
            if q in used:
                continue
            used.add(q)
            chain.append(c)
            messages = [m for x in chain for m in x.messages]
            turns = sum(1 for i in assistant_positions(messages) if i > 0)
            if turns >= max_turns or last_prompt(messages, c.tools) >= max_context:
                chains.append(_joined(chain))
                chain = []
        if chain:
            chains.append(_joined(chain))
    return others + chains


def select_sessions(sessions: list[Session], n: int, min_turns: int, claude_extra: int = 0) -> list[Session]:
    eligible = [s for s in sessions if s.turns and len(s.turns) >= min_turns]
    eligible.sort(key=lambda s: (s.source != "claude-code", -len(s.turns), -s.turns[-1].prompt_tokens, s.id))
    out, seen = [], set()
    for s in eligible:
        if len(out) == n:
            break
        qs = s.questions()
        if qs & seen:
            continue
        seen |= qs
        out.append(s)
    shorter = [s for s in sessions if s.source == "claude-code" and 2 <= len(s.turns) < min_turns]
    shorter.sort(key=lambda s: (-len(s.turns), -s.turns[-1].prompt_tokens, s.id))
    return out + shorter[:claude_extra]


def plan_probes(sessions: list[Session], exclude: list[Session], n: int, prompt: int = 4000, added: int = 200,
                prompt_window: float = 0.15, added_window: tuple[float, float] = (0.5, 1.6)) -> list[Probe]:
    """Up to n probes from sessions not in `exclude` and sharing no BFCL question with it: per session
    the consecutive turns (a, b) with prompt(a) within prompt*(1 -+ prompt_window) and
    prompt(b) - prompt(a) within added*added_window that minimise |prompt(a)/prompt - 1| + |added'/added - 1|."""
    taken_ids = {s.id for s in exclude}
    taken_qs = set().union(*(s.questions() for s in exclude)) if exclude else set()
    scored = []
    for s in sessions:
        if s.id in taken_ids or s.questions() & taken_qs:
            continue
        best = None
        for a, b in zip(s.turns, s.turns[1:]):
            grow = b.prompt_tokens - a.prompt_tokens
            if abs(a.prompt_tokens - prompt) > prompt_window * prompt:
                continue
            if not added_window[0] * added <= grow <= added_window[1] * added:
                continue
            score = abs(a.prompt_tokens / prompt - 1) + abs(grow / added - 1)
            if best is None or score < best[0]:
                best = (score, a, b)
        if best:
            scored.append((best[0], s.id, Probe(s, best[1], best[2])))
    scored.sort(key=lambda x: (x[0], x[1]))
    out, seen = [], set()
    for _, _, p in scored:
        if len(out) == n:
            break
        if p.session.questions() & seen:
            continue
        seen |= p.session.questions()
        out.append(p)
    return out


def _claude_id(conv) -> str:
    """A stable id without the machine's paths: file name, plus the subagent chain when there is one."""
    name = Path(conv.source).name
    chain = conv.id.rsplit("#", 1)[1] if "#" in conv.id else ""
    return f"claude-code/{name}" + (f"#{chain}" if chain else "")


def load_conversations(claude_dir: Path | None, bfcl_categories: list[str], notes: list[str]) -> list[Candidate]:
    out: list[Candidate] = []
    if claude_dir is not None:
        from index.traces import ReadReport, iter_conversations

        if not claude_dir.is_dir():
            notes.append(f"no Claude Code samples: {claude_dir.name!r} is not a directory (--claude-samples DIR)")
        else:
            report = ReadReport()
            for conv in iter_conversations([claude_dir], report):
                out.append(Candidate(_claude_id(conv), "claude-code", conv.messages, conv.tools))
            if report.skipped:
                notes.append(f"Claude Code samples: {len(report.skipped)} lines skipped by the reader")
    if bfcl_categories:
        try:
            from index.bfcl import bfcl_split, iter_bfcl_conversations
            from common.paths import BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED

            _, held_out = bfcl_split(iter_bfcl_conversations(bfcl_categories), BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED)
        except (ImportError, FileNotFoundError) as e:
            notes.append(f"no BFCL sessions: the bfcl-eval data is not available ({e})")
            held_out = []
        out += [Candidate(c.key(), "bfcl", c.messages, c.tools) for c in held_out]
    return out
