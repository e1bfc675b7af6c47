"""Token trees: several continuations merged into one tree, verified in one forward (ngram.draft).

Contract: `merge(main, main_conf, others, budget)` -> (tokens, confidences, parents) or None. `main`
is the chosen continuation, `others` are further continuations with their cumulative confidences,
all as encoded text (ngram.codec: a character per token). The tree is laid out as ngram.draft says:
main's tokens first (a chain, parents -1, 0, 1, ...), then, for each other continuation in order
of its expected accepted length (the sum of its confidences), the tokens where it departs from the
tree built so far, each a child of the node before it. At most `budget` tokens in all; None when no
other continuation adds a token (the draft stays a chain).

Off by default (DrafterConfig.tree; `--tree` turns it on). On the bundled model's CPU engine, A/B
over 6 requests per workload (greedy and T 1.0), trees were level on tool calls (1.71x plain either
way) and below chains on agentic requests (1.63x vs 1.96x): branch rows cost verify time there, and
the branches' confidences (another source's walk) are not calibrated against the main chain's.

Why only where main leaves room: on the chained agent conversations of bench.long_context, with the
same tokens per verify, cutting the main chain to make room for branches lost more than the branches
won (16 tokens: tau 7.18 -> 6.83 when nodes were picked by confidence), while branches after a full
main chain added a little (7.18 -> 7.19 at 16 tokens, 8.23 -> 8.27 at 32).
"""
from __future__ import annotations


def merge(main: str, main_conf: list, others: list[tuple[str, list]], budget: int):
    if len(main) >= budget or not others:
        return None
    tokens, confs = list(main), list(main_conf)
    parents = list(range(-1, len(main) - 1))
    node_of = {main[: i + 1]: i for i in range(len(main))}  # a path's text -> its last node
    for alt, conf in sorted(others, key=lambda o: -sum(o[1])):
        i, parent = 0, -1
        while i < len(alt) and alt[: i + 1] in node_of:
            parent = node_of[alt[: i + 1]]
            i += 1
        while i < len(alt) and len(tokens) < budget:
            tokens.append(alt[i])
            confs.append(conf[i])
            parents.append(parent)
            parent = len(tokens) - 1
            node_of[alt[: i + 1]] = parent
            i += 1
        if len(tokens) >= budget:
            break
    if len(tokens) == len(main):
        return None
    return "".join(tokens), confs, parents
