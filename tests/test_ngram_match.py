"""The matching kernels and the drafter on hand-written token arrays."""
import numpy as np
import pytest

from ngram.codec import decode, encode
from ngram.drafter import DrafterConfig, NgramDrafter, PromptLookupDrafter
from ngram.index_file import BuildParams, write_index, load_index
from ngram.match import context_match, longest_index_match, prompt_lookup, walk


def test_codec_round_trip_covers_surrogate_gap_and_large_ids():
    ids = [0, 1, 55294, 55295, 55296, 57000, 262143, 106]
    assert decode(encode(ids)) == ids
    assert decode(encode(np.array(ids * 20))) == ids * 20  # the numpy path
    assert encode([1, 2]) < encode([1, 3]) < encode([2])  # order-preserving


def test_walk_takes_the_heavier_branch_and_multiplies_confidence():
    # after "A": B (weight 3) vs C (weight 1); after "AB": D always
    rows = sorted([(encode([1, 2, 4]), 3), (encode([1, 3, 5]), 1)])
    drafted, confs = walk(rows, 1, 8, cutoff=0.0)
    assert decode(drafted) == [2, 4]
    assert confs == pytest.approx([0.75, 0.75])


def test_walk_tie_goes_to_lower_token_id():
    rows = sorted([(encode([1, 9, 4]), 2), (encode([1, 7, 5]), 2)])
    drafted, confs = walk(rows, 1, 8, cutoff=0.0)
    assert decode(drafted) == [7, 5] and confs[0] == pytest.approx(0.5)


def test_walk_stops_at_the_cutoff():
    rows = sorted([(encode([1, 2]), 1), (encode([1, 3]), 1), (encode([1, 4]), 1)])
    assert walk(rows, 1, 8, cutoff=0.5) == ("", [])


def test_context_match_finds_longest_suffix_and_most_recent_first():
    #        0  1  2  3  4  5  6  7  8  9
    ctx = [5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    k, starts = context_match(encode(ctx), 2, 16, 8)
    assert k == 3  # "1 2 3" occurs twice before the end; "9 1 2 3"/"8 1 2 3" do not
    assert starts == [8, 4]  # continuation offsets, most recent first


def test_context_draft_tie_goes_to_most_recent_occurrence():
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    draft = NgramDrafter(None, DrafterConfig(confidence_cutoff=0.1)).propose(ctx, 4)
    assert draft.source == "context" and draft.tokens[0] == 8
    assert draft.confidence[0] == pytest.approx(0.5, abs=0.01)


def test_prompt_lookup_matches_transformers_algorithm():
    ctx = np.array([7, 1, 2, 5, 6, 1, 2, 9, 3, 1, 2])
    # earliest occurrence of the last 2-gram (1, 2) with a continuation: index 1 -> [5, 6, 1]
    assert prompt_lookup(ctx, 3, max_ngram=2) == [5, 6, 1]
    assert prompt_lookup(np.array([4, 4]), 3) == [4]  # 1-gram fallback, capped at the end
    assert prompt_lookup(np.array([1, 2, 3]), 3) == []


def _index(tmp_path, turns, **params):
    write_index(tmp_path, [np.array(t, dtype=np.uint32) for t in turns], "fp", BuildParams(**params))
    return load_index(tmp_path, "fp")


def test_longest_index_match_binary_search(tmp_path):
    idx = _index(tmp_path, [[1, 2, 3, 4, 5, 6]])
    def has(prefix):
        return next(idx.trie.iterkeys(prefix), None) is not None

    assert longest_index_match(has, encode([9, 9, 2, 3, 4]), 2, 16) == 3
    assert longest_index_match(has, encode([9, 9, 2, 3, 4]), 4, 16) == 0
    assert longest_index_match(has, encode([7, 8]), 1, 16) == 0
    assert longest_index_match(has, encode([1, 2, 3, 4]), 1, 16, upper_hint=2) == 2


def test_index_drafter_prefers_frequent_continuation(tmp_path):
    turns = [[10, 11, 12, 13, 14]] * 3 + [[10, 11, 12, 20, 21]]
    idx = _index(tmp_path, turns)
    draft = NgramDrafter(idx, DrafterConfig(use_context=False, confidence_cutoff=0.5)).propose([99, 10, 11, 12], 4)
    assert draft.source == "index" and draft.match_length == 3
    assert draft.tokens == [13, 14]
    assert draft.confidence == pytest.approx([0.75, 0.75])


def test_drafter_longer_match_wins_between_sources(tmp_path):
    idx = _index(tmp_path, [[1, 2, 3, 4, 5]])
    # context holds "7 1 2 3 6": a 4-token match ("7 1 2 3"... no: suffix is 7 1 2 3) beats the index's 3
    ctx = [7, 1, 2, 3, 6, 0, 7, 1, 2, 3]
    draft = NgramDrafter(idx, DrafterConfig()).propose(ctx, 4)
    assert draft.source == "context" and draft.tokens[0] == 6 and draft.match_length == 4
    draft = NgramDrafter(idx, DrafterConfig()).propose([0, 1, 2, 3], 4)
    assert draft.source == "index" and draft.tokens == [4, 5]


def test_draft_never_exceeds_max_tokens_and_length_adapts(tmp_path):
    idx = _index(tmp_path, [list(range(100, 140))])
    drafter = NgramDrafter(idx, DrafterConfig(max_draft=8, min_draft=2, use_context=False))
    session = drafter.session()
    ctx = list(range(100, 104))
    assert len(session.propose(ctx, 3)) == 3
    assert len(session.propose(ctx, 100)) == 8
    session.feedback(drafted=8, accepted=1)
    assert len(session.propose(ctx, 100)) == 7  # one shorter after a rejection
    for _ in range(10):
        session.feedback(drafted=4, accepted=0)
    assert len(session.propose(ctx, 100)) == 2  # never below min_draft
    session.feedback(drafted=2, accepted=2)
    assert len(session.propose(ctx, 100)) == 4  # grows after a full acceptance


def test_session_follows_a_growing_context_like_a_fresh_one(tmp_path):
    rng = np.random.default_rng(0)
    turns = [rng.integers(0, 50, size=30).tolist() for _ in range(40)]
    idx = _index(tmp_path, turns)
    drafter = NgramDrafter(idx, DrafterConfig(max_draft=6, grow=0, min_draft=6))
    session = drafter.session()
    ctx = turns[3][:3]
    for t in turns[3][3:] + turns[5]:
        ctx = ctx + [t]
        assert session.propose(ctx, 6).tokens == drafter.propose(ctx, 6).tokens


def test_session_past_the_context_window_matches_a_fresh_one():
    # the session keeps between window and 2 x window tokens and cuts back; a fresh session encodes
    # only the last window tokens: both search the same window, so they must draft the same
    rng = np.random.default_rng(1)
    drafter = NgramDrafter(None, DrafterConfig(max_draft=6, grow=0, min_draft=6, context_window=12, overlay_tokens=0))
    session = drafter.session()
    ctx, sources = [], set()
    for t in rng.integers(0, 6, size=80).tolist():
        ctx = ctx + [t]
        mine, fresh = session.propose(ctx, 6), drafter.propose(ctx, 6)
        assert (mine.tokens, mine.source) == (fresh.tokens, fresh.source)
        sources.add(mine.source)
    assert sources == {"context", "none"}


def test_prompt_lookup_drafter_is_fixed_length():
    d = PromptLookupDrafter(max_draft=2)
    assert d.session().propose([1, 2, 3, 1], 10).tokens == [2, 3]


def test_overlay_learns_finished_requests():
    drafter = NgramDrafter(None, DrafterConfig(use_context=True))
    first = drafter.session()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    completion = [40, 41, 42, 43, 44, 45]
    first.propose(prompt, 4)
    first.finish(prompt + completion)
    second = drafter.session()
    draft = second.propose([9, 9, 9, 9, 5, 6, 7, 40, 41], 4)  # a new prompt, same completion start
    assert draft.source == "overlay" and draft.tokens == [42, 43, 44, 45]
