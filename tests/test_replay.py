"""The replay simulator against a hand-computed case, and the CLI end to end on a tiny index."""
import json

import numpy as np
import pytest

from ngram.draft import Draft
from index.replay import main
from ngram.replay import ReplayStats, replay_turn


class ScriptedDrafter:
    """Proposes fixed drafts in order; records what it was asked."""

    def __init__(self, drafts):
        self.drafts = list(drafts)
        self.asked = []
        self.feedback_log = []

    def session(self):
        return self

    def propose(self, context, max_tokens):
        self.asked.append((len(context), max_tokens))
        tokens = np.asarray(self.drafts.pop(0), dtype=np.int32)[:max_tokens]
        return Draft(tokens, np.ones(len(tokens), dtype=np.float32), "scripted", 1)

    def feedback(self, drafted, accepted):
        self.feedback_log.append((drafted, accepted))

    def prepare(self, context_ids):
        pass

    def finish(self, context_ids=None):
        pass


def test_replay_hand_computed():
    # target 1..6. step 1: draft [1,2,9] -> 2 accepted + target's 3 (pos 3)
    # step 2: no draft -> plain step (pos 4); step 3: [5,6,7] capped to the 2 left -> both accepted (pos 6)
    drafter = ScriptedDrafter([[1, 2, 9], [], [5, 6, 7]])
    stats = ReplayStats()
    replay_turn(drafter, np.array([42, 43]), np.array([1, 2, 3, 4, 5, 6]), max_draft=3, stats=stats)
    d = stats.as_dict()
    assert d["verify_steps"] == 3 and d["target_tokens"] == 6
    assert d["tau"] == pytest.approx(2.0)
    assert (d["drafted_tokens"], d["accepted_tokens"]) == (5, 4)
    assert d["acceptance_rate"] == pytest.approx(0.8)
    assert drafter.asked == [(2, 3), (5, 3), (6, 2)]  # context grows by what was committed
    assert drafter.feedback_log == [(3, 2), (0, 0), (2, 2)]


def test_replay_cli_prints_json_last_and_beats_baseline_on_repetitive_turns(tmp_path, capsys):
    from ngram.index_file import BuildParams, write_index

    rng = np.random.default_rng(1)
    template = rng.integers(1000, 2000, size=20)
    turns = [np.concatenate([template, rng.integers(0, 50, size=3)]).astype(np.uint32) for _ in range(10)]
    write_index(tmp_path / "idx", turns, "fp", BuildParams())
    dump = tmp_path / "turns.jsonl"
    with open(dump, "w") as f:
        for _ in range(3):
            f.write(json.dumps({"context": rng.integers(3000, 4000, size=30).tolist(),
                                "target": np.concatenate([template, [7, 7]]).tolist()}) + "\n")
    assert main(["--index", str(tmp_path / "idx"), "--from-dump", str(dump), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("tau", "acceptance_rate", "target_tokens", "verify_steps", "draft_us_p50", "draft_us_p99"):
        assert key in result and key in result["baseline"]
    assert result["target_tokens"] == 3 * 22
    assert result["tau"] > 2 * result["baseline"]["tau"]


def test_a_tree_accepts_its_longest_matching_root_path():
    from ngram.replay import tree_accepted

    # root -> 5 -> 6 -> 7 and root -> 5 -> 8, root -> 9: parents before children
    tokens, parents = [5, 9, 6, 8, 7], [-1, -1, 0, 0, 2]
    assert tree_accepted(tokens, parents, [5, 6, 7, 1]) == 3
    assert tree_accepted(tokens, parents, [5, 8, 7]) == 2
    assert tree_accepted(tokens, parents, [9, 9]) == 1
    assert tree_accepted(tokens, parents, [4]) == 0
    assert tree_accepted(tokens, parents, [5, 6]) == 2  # the turn ends inside the tree
