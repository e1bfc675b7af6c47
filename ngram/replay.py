"""Offline replay: how well would a drafter have done on recorded turns? No model needed.

`replay(drafter, turns, max_draft)` replays (context ids, target ids) pairs; the command line that
reads traces into such turns is `index.replay` (ngram knows nothing of traces; `python -m ngram.replay`
is kept as that command's name and hands over to it):

    python -m ngram.replay --index DIR --traces PATH [PATH ...] [--tokenizer DIR] [--max-draft K] --json
    python -m ngram.replay --index DIR --bfcl-holdout --json      # BFCL v4 turns the default index excludes
    python -m ngram.replay --index DIR --from-dump FILE --json    # turns dumped by an earlier --dump

Each assistant turn is replayed as if the target had produced exactly its tokens, under greedy
verification: per step the drafter proposes up to K tokens (never past the turn's end), the longest
prefix that matches the target's tokens is accepted (of a token tree: the longest root path), and
the target adds one token of its own (the first mismatch, or the next token). A step with no draft
is a plain decoding step. After each turn the drafter learns it (its online overlay, as in the
server), so turns are replayed in trace order.
  tau              = target tokens / verify steps (every target forward counts as a step)
  acceptance_rate  = accepted drafted tokens / drafted tokens
  draft_us_p50/p99 = wall time of each propose() call
  prepare_us_p50/p99 = wall time of each turn's session.prepare(prompt) (encoding and indexing the
                   prompt, which the server does before the prefill), per turn
The same figures are computed under `baseline` for transformers' prompt lookup (the request's own
context only, same K), so every run compares the two. With --json the last line printed is one JSON
object. `--dump FILE` writes every replayed turn as JSONL {"context": [ids], "target": [ids]}.

Keep replayed traces out of the index they replay against: the default index leaves out the BFCL
held-out split (common.paths), and `--bfcl-holdout` replays exactly that split.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np



@dataclass
class ReplayStats:
    turns: int = 0
    target_tokens: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    latencies_us: list = field(default_factory=list)
    prepare_us: list = field(default_factory=list)  # per turn: session.prepare(prompt)
    draft_lengths: list = field(default_factory=list)  # tokens verified per step (0: plain step)

    def as_dict(self) -> dict:
        lat = np.asarray(self.latencies_us) if self.latencies_us else np.zeros(1)
        return {
            "tau": self.target_tokens / max(self.verify_steps, 1),
            "acceptance_rate": self.accepted / max(self.drafted, 1),
            "target_tokens": self.target_tokens,
            "verify_steps": self.verify_steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "turns": self.turns,
            "draft_us_p50": float(np.percentile(lat, 50)),
            "draft_us_p99": float(np.percentile(lat, 99)),
            "prepare_us_p50": float(np.percentile(self.prepare_us or [0.0], 50)),
            "prepare_us_p99": float(np.percentile(self.prepare_us or [0.0], 99)),
        }


def replay_turn(drafter, context: np.ndarray, target: np.ndarray, max_draft: int, stats: ReplayStats) -> None:
    """Replay one turn (see the module docstring for the acceptance rule)."""
    full = np.concatenate([context, target]).astype(np.int64)
    n_ctx, n = context.shape[0], target.shape[0]
    session = drafter.session()
    t0 = time.perf_counter()
    session.prepare(context)
    stats.prepare_us.append((time.perf_counter() - t0) * 1e6)
    pos = 0
    while pos < n:
        remaining = n - pos
        t0 = time.perf_counter()
        draft = session.propose(full[: n_ctx + pos], min(max_draft, remaining))
        stats.latencies_us.append((time.perf_counter() - t0) * 1e6)
        if draft.parents is not None:  # a tree: the longest root path that the target follows
            proposed = np.asarray(draft.tokens, dtype=np.int64)
            accepted = tree_accepted(proposed.tolist(), list(draft.parents), target[pos:].tolist())
        else:
            proposed = np.asarray(draft.tokens[:remaining], dtype=np.int64)
            agree = proposed == target[pos : pos + proposed.shape[0]]
            accepted = int(proposed.shape[0] if agree.all() else np.argmin(agree))
        session.feedback(int(proposed.shape[0]), accepted)
        stats.drafted += int(proposed.shape[0])
        stats.accepted += accepted
        stats.verify_steps += 1
        stats.draft_lengths.append(int(proposed.shape[0]))
        pos += min(accepted + 1, remaining)
    session.finish(full)  # the completed turn feeds the drafter's online overlay
    stats.turns += 1
    stats.target_tokens += n


def tree_accepted(tokens: list[int], parents: list[int], target: list[int]) -> int:
    """How many target tokens a token tree (ngram.draft's layout) accepts: the length of its longest
    path from the root whose tokens are target's first ones."""
    node, accepted = -1, 0
    while accepted < len(target):
        child = next((i for i, p in enumerate(parents) if p == node and tokens[i] == target[accepted]), -1)
        if child < 0:
            break
        node, accepted = child, accepted + 1
    return accepted


def replay(drafter, turns: Iterable[tuple[np.ndarray, np.ndarray]], max_draft: int) -> ReplayStats:
    stats = ReplayStats()
    for context, target in turns:
        if target.shape[0]:
            replay_turn(drafter, context, target, max_draft, stats)
    return stats




if __name__ == "__main__":
    # A process hand-off, not an import: the command's name stays, the layering stays one way.
    os.execv(sys.executable, [sys.executable, "-m", "index.replay", *sys.argv[1:]])
