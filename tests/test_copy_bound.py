"""The copy bound (bench/copy_bound.py): hand-computed cases, and no real drafter above it."""
import numpy as np

from bench.copy_bound import copy_bound
from ngram.index_file import BuildParams, load_index, write_index
from ngram.drafter import DrafterConfig, NgramDrafter, PromptLookupDrafter
from ngram.replay import replay


def _turn(ctx, target):
    return np.asarray(ctx, np.int64), np.asarray(target, np.int64)


def test_copy_bound_hand_computed():
    # [1,2,3] is in the context, [1,2,3,9] is not: 3 drafted, then 9. Then [1,2,3,9] has been
    # generated, so the second copy is drafted whole.
    s = copy_bound([[_turn([1, 2, 3, 4, 5], [1, 2, 3, 9, 1, 2, 3, 9])]], [], 16)
    assert (s.verify_steps, s.draft_lengths) == (2, [3, 4])
    # a seed turn supplies [7,8,9,1]; [3,9] appears only later in the target, so only 3 is copied
    s = copy_bound([[_turn([1, 2, 3, 4, 5], [7, 8, 9, 1, 2, 3, 9])]], [[7, 8, 9, 1]], 16)
    assert (s.verify_steps, s.draft_lengths) == (2, [4, 1])
    # runs never cross two seed turns, and drafts stop at max_draft
    s = copy_bound([[_turn([], [1, 2, 3, 4])]], [[1, 2], [3, 4]], 2)
    assert s.draft_lengths == [2, 1]


def test_no_drafter_beats_the_copy_bound(tmp_path):
    rng = np.random.default_rng(0)
    phrases = [rng.integers(10, 60, size=rng.integers(3, 12)).tolist() for _ in range(8)]
    seed = [sum((phrases[i] for i in rng.integers(0, 8, size=6)), []) for _ in range(30)]
    history, chain = [], []
    for _ in range(12):
        ctx = history + sum((phrases[i] for i in rng.integers(0, 8, size=4)), [])
        target = sum((phrases[i] for i in rng.integers(0, 8, size=5)), []) + rng.integers(10, 60, size=3).tolist()
        chain.append(_turn(ctx, target))
        history = ctx + target
    write_index(tmp_path, [np.array(t, dtype=np.uint32) for t in seed], "fp", BuildParams())
    index = load_index(tmp_path, "fp")
    bound = copy_bound([chain], seed, 16).as_dict()["tau"]
    for drafter in (NgramDrafter(index, DrafterConfig(max_draft=16)), NgramDrafter(None, DrafterConfig(max_draft=16)),
                    PromptLookupDrafter(max_draft=16)):
        tau = replay(drafter, chain, 16).as_dict()["tau"]
        assert 1.0 < tau <= bound


def test_learned_turns_count_only_after_they_were_replayed():
    # turn 0 generates [5,6,7,8]; turn 1 (another request, its own context) copies it only with learn
    turns = [_turn([1, 2], [5, 6, 7, 8]), _turn([3, 4], [5, 6, 7, 8])]
    assert copy_bound([turns], [], 16).draft_lengths == [0, 0, 0, 0, 0, 0, 0, 0]
    s = copy_bound([turns], [], 16, learn=True)
    assert s.draft_lengths == [0, 0, 0, 0, 4]  # the second turn copies its whole target in one verify
    # a later turn's text is never learned early: reversed, the first turn still copies nothing
    s = copy_bound([turns[::-1]], [], 16, learn=True)
    assert s.draft_lengths[:4] == [0, 0, 0, 0]


def test_no_learning_drafter_beats_the_learned_bound():
    rng = np.random.default_rng(1)
    phrases = [rng.integers(10, 60, size=rng.integers(3, 12)).tolist() for _ in range(6)]
    turns = [_turn(sum((phrases[i] for i in rng.integers(0, 6, size=3)), []),
                   sum((phrases[i] for i in rng.integers(0, 6, size=4)), []) + rng.integers(10, 60, size=2).tolist())
             for _ in range(20)]
    bound = copy_bound([turns], [], 16, learn=True).as_dict()["tau"]
    assert bound > copy_bound([turns], [], 16).as_dict()["tau"]
    tau = replay(NgramDrafter(None, DrafterConfig(max_draft=16)), turns, 16).as_dict()["tau"]
    assert 1.0 < tau <= bound
