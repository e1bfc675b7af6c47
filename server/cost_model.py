"""When drafting pays: the verify cost curve and the per-step draft / no-draft rule.

Contract: `server.backend.measure_cost_curve(backend, ...)` gives `cost[n]`, the time of an n-token
forward relative to a 1-token forward (`cost[1] == 1`). `DraftPolicy` holds that curve and the rule's constants; a per-request
`AcceptanceTracker` holds the request's acceptance history. `DraftPolicy.choose(draft, tracker)`
returns how many drafted tokens to verify this step (0 = decode plainly); for a token tree,
`DraftPolicy.tree_branches` then picks the branch nodes to verify beside that main chain.

The rule. A verify step with n drafted tokens feeds n+1 tokens (the pending token plus the draft)
and yields 1 + (number of accepted drafted tokens) tokens. With p_i the probability that the first
i drafted tokens are all accepted,

    expected_tokens(n) = 1 + sum_{i<=n} p_i,      p_i = min(confidence_i, alpha ** i)

where `confidence_i` is the drafter's own estimate and `alpha` is the request's per-token
acceptance rate (a decayed count of accepted vs rejected drafted tokens, starting from a prior of
ALPHA_PRIOR_ACCEPTED : ALPHA_PRIOR_REJECTED pseudo-tokens). A plain step yields 1 token at cost 1.
Draft the n that maximises expected_tokens(n) / cost[n + 1], and only when that ratio exceeds
1 + MARGIN; otherwise decode plainly.

Sharing a forward (several requests batched, server/batcher.py): with k other requests carrying R
rows in the same forward, the step's time is cost[R + n + 1] and it yields k + expected_tokens(n)
tokens (the others' at least one each), against (k + 1) / cost[R + 1] for a plain step; so the rule
drafts the n that maximises (k + expected_tokens(n)) / cost[R + n + 1], and only when that beats the
plain step's rate by MARGIN. Alone (k = R = 0) this is the rule above. Past the measured curve the
cost grows linearly, at the mean slope of its last four points (a compute-bound forward's rows cost
alike). A long draft from every request of a batch would make each forward slower than the tokens
it adds: on a CPU whose 16-token verify already costs 2.5 steps, the rule drafts less there.

Probing: once the rule has refused drafts, alpha no longer updates. After `probe_interval` plain
steps that refused a non-empty draft, one probe verifies up to PROBE_TOKENS drafted tokens anyway;
each failed probe doubles the interval (up to PROBE_INTERVAL_MAX) and any accepted token resets it.
A drafter match of at least PROBE_MATCH_LENGTH context tokens also triggers a probe. Empty drafts
cost nothing and never count toward a probe.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MARGIN = 0.05                 # demanded gain over plain decoding, for timing noise
ALPHA_PRIOR_ACCEPTED = 2.0    # prior pseudo-counts: alpha starts at 2/3
ALPHA_PRIOR_REJECTED = 1.0
ALPHA_DECAY = 0.8             # per verify step: history half-life of about 3 steps
PROBE_INTERVAL = 8            # refused non-empty drafts before the first probe
PROBE_INTERVAL_MAX = 64
PROBE_TOKENS = 4
PROBE_MATCH_LENGTH = 24


@dataclass
class AcceptanceTracker:
    """Per-request acceptance history (decayed counts) and probe state."""

    accepted: float = 0.0
    rejected: float = 0.0
    refused_since_probe: int = 0
    probe_interval: int = PROBE_INTERVAL

    @property
    def alpha(self) -> float:
        a = self.accepted + ALPHA_PRIOR_ACCEPTED
        return a / (a + self.rejected + ALPHA_PRIOR_REJECTED)

    def record(self, drafted: int, accepted: int, probe: bool) -> None:
        self.accepted = ALPHA_DECAY * self.accepted + accepted
        self.rejected = ALPHA_DECAY * self.rejected + (1 if accepted < drafted else 0)
        if probe:
            self.refused_since_probe = 0
            if accepted == 0:
                self.probe_interval = min(2 * self.probe_interval, PROBE_INTERVAL_MAX)
        if accepted > 0:
            self.probe_interval = PROBE_INTERVAL


@dataclass
class DraftPolicy:
    cost: np.ndarray                   # cost[n] for n new tokens, cost[0] unused; its length bounds drafts
    margin: float = MARGIN

    @property
    def max_draft(self) -> int:
        return len(self.cost) - 2

    def choose(self, confidence: np.ndarray, match_length: int, tracker: AcceptanceTracker,
               others: tuple[int, int] = (0, 0)) -> tuple[int, bool]:
        """(number of drafted tokens to verify, whether this is a probe); 0 means decode plainly.
        `others`: (requests, rows) sharing the forward besides this one (see the module docstring)."""
        m = min(len(confidence), self.max_draft)
        if m == 0:
            return 0, False
        n, gain = self.best_length(confidence[:m], tracker.alpha, others)
        if gain > 1.0 + self.margin:
            return n, False
        tracker.refused_since_probe += 1
        if tracker.refused_since_probe >= tracker.probe_interval or match_length >= PROBE_MATCH_LENGTH:
            return min(m, PROBE_TOKENS), True
        return 0, False

    def best_length(self, confidence: np.ndarray, alpha: float, others: tuple[int, int] = (0, 0)) -> tuple[int, float]:
        """argmax_n of the draft's tokens per cost over n = 1..len(confidence), and its ratio to a
        plain step's (alone: expected_tokens(n) / cost[n+1]; shared: see the module docstring)."""
        k, rows = others
        n = np.arange(1, len(confidence) + 1)
        p = np.minimum(np.clip(confidence, 0.0, 1.0), alpha ** n)
        ratio = (k + 1.0 + np.cumsum(p)) / self.cost_of(rows + n + 1)
        best = int(np.argmax(ratio))
        return best + 1, float(ratio[best] * self.cost_of(np.array([rows + 1]))[0] / (k + 1.0))

    def tree_branches(self, parents, confidence, chain: int, n: int, alpha: float, max_nodes: int,
                      max_depth: int) -> list[int]:
        """The branch nodes of a token tree (ngram.draft's layout, its main chain the first `chain`
        tokens) to verify beside the main chain's first n: in the tree's order, each one whose parent
        is kept and whose depth is at most max_depth, while it raises the expected tokens per cost
        (the chain rule above, a node counting its confidence capped by alpha ** depth) and the step
        fits in max_nodes drafted tokens."""
        kept = set(range(min(n, chain)))
        depth = {i: i + 1 for i in kept}
        expected = 1.0 + sum(min(float(confidence[i]), alpha ** (i + 1)) for i in kept)
        out: list[int] = []
        for j in range(chain, len(parents)):
            if n + len(out) >= max_nodes or n + len(out) + 2 >= len(self.cost):
                break
            p = parents[j]
            if p != -1 and p not in kept:
                continue
            d = 1 if p == -1 else depth[p] + 1
            if d > max_depth:
                continue
            gain = min(float(confidence[j]), alpha ** d)
            size = n + len(out)  # drafted tokens so far: the step feeds size + 1
            if (expected + gain) / self.cost[size + 2] <= expected / self.cost[size + 1]:
                continue
            kept.add(j)
            depth[j] = d
            expected += gain
            out.append(j)
        return out

    def cost_of(self, rows: np.ndarray) -> np.ndarray:
        """cost[rows], extended linearly past the measured curve (the mean slope of its last 4 points)."""
        rows = np.asarray(rows)
        last = len(self.cost) - 1
        inside = self.cost[np.minimum(rows, last)]
        if rows.max(initial=0) <= last:
            return inside
        tail = self.cost[max(1, last - 4) :]
        slope = max(0.0, float(tail[-1] - tail[0]) / max(1, len(tail) - 1))
        return np.where(rows > last, self.cost[last] + slope * (rows - last), inside)


def flat_policy(max_draft: int) -> DraftPolicy:
    """A policy for a verify step that costs the same as a plain step (e.g. tests)."""
    return DraftPolicy(np.ones(max_draft + 2))
