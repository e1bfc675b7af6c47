"""ngram.context_index against a brute-force scan of the text, through appends, merges and rewrites."""
import numpy as np
import pytest

from ngram import context_index, sources
from ngram.codec import encode
from ngram.context_index import KEY_LENGTHS, ContextIndex, ContextIndexCache
from ngram.drafter import DrafterConfig, NgramDrafter


def brute_candidates(text: str, tail: str, count: int) -> tuple[list[int], int]:
    for length in KEY_LENGTHS:
        if len(tail) < length:
            continue
        key = tail[-length:]
        offsets = [i for i in range(length, len(text)) if text[i - length : i] == key]
        if offsets:
            return offsets[-count:], length
    return [], 0


@pytest.mark.parametrize("alphabet", [3, 40, 5000])
def test_candidates_match_a_brute_force_scan(alphabet, monkeypatch):
    monkeypatch.setattr(context_index, "MERGE_TOKENS", 37)  # merge often
    rng = np.random.default_rng(alphabet)
    ids: list[int] = []
    index, text = ContextIndex(), ""
    for step in range(400):
        roll = rng.random()
        if roll < 0.1 and len(ids) > 20:  # copy an earlier stretch (long matches)
            at = int(rng.integers(0, len(ids) - 10))
            ids += ids[at : at + int(rng.integers(5, 30))]
        elif roll < 0.15:  # a big append (the numpy merge path)
            ids += rng.integers(0, alphabet, size=int(rng.integers(64, 300))).tolist()
        elif roll < 0.2 and len(ids) > 50:  # a new request that shares only a prefix
            ids = ids[: int(rng.integers(10, len(ids)))] + rng.integers(0, alphabet, size=5).tolist()
        else:
            ids += rng.integers(0, alphabet, size=int(rng.integers(1, 4))).tolist()
        new = encode(ids)
        if not new.startswith(text):
            cache = ContextIndexCache()
            cache.put(index, text)
            index = cache.take(new)  # rewound to the shared start
        index.extend(new)
        text = new
        for count in (1, 4, 32):
            assert index.candidates(text, count) == brute_candidates(text, text, count), step


def test_the_cache_hands_the_next_turn_the_index_that_shares_most():
    cache = ContextIndexCache(size=2)
    turn = [encode(list(range(n))) for n in (100, 200, 300)]
    indexes = []
    for text in turn:
        index = ContextIndex()
        index.extend(text)
        cache.put(index, text)
        indexes.append(index)
    assert len(cache._entries) == 2  # the oldest was dropped
    nxt = encode(list(range(250)) + [7, 7, 7])
    taken = cache.take(nxt)
    assert taken is indexes[2] and taken.length == 250  # rewound to the shared start
    assert cache.take(nxt) is indexes[1] and indexes[1].length == 200
    assert cache.take(nxt).length == 0  # nothing left: a new index


def _copying_turns(rng, n_turns: int, alphabet: int) -> list[list[int]]:
    """A conversation's contexts, each the previous one plus a completion and new tokens, with copies."""
    ctx = rng.integers(0, alphabet, size=50).tolist()
    out = []
    for _ in range(n_turns):
        for _ in range(6):
            at = int(rng.integers(0, len(ctx) - 10))
            ctx = ctx + ctx[at : at + int(rng.integers(4, 20))] + rng.integers(0, alphabet, size=3).tolist()
        out.append(ctx)
    return out


def _drafts(drafter, contexts, steps: int = 30) -> list:
    got = []
    for ctx in contexts:
        session = drafter.session()
        full = list(ctx)
        for _ in range(steps):
            draft = session.propose(full, 8)
            got.append((list(draft.tokens), draft.source, draft.match_length))
            full = full + (list(draft.tokens[:2]) or [7])
        session.finish(full)
    return got


def test_indexed_context_search_reuses_the_cache_without_changing_a_draft(monkeypatch):
    # the indexed search (forced on with a tiny threshold) drafts the same whether a turn takes the
    # previous turn's index from the cache or builds its own
    monkeypatch.setattr(sources, "EXACT_SEARCH_TOKENS", 16)
    rng = np.random.default_rng(5)
    contexts = _copying_turns(rng, 5, 50)
    cfg = DrafterConfig(max_draft=8, overlay_tokens=0)
    cached, uncached = NgramDrafter(None, cfg), NgramDrafter(None, cfg)
    uncached.context_indexes = ContextIndexCache(size=0)
    a, b = _drafts(cached, contexts), _drafts(uncached, contexts)
    assert a == b
    assert sum(source == "context" for _, source, _ in a) > len(a) // 2


def test_indexed_search_sees_only_the_window(monkeypatch):
    monkeypatch.setattr(sources, "EXACT_SEARCH_TOKENS", 8)
    rng = np.random.default_rng(2)
    ctx = [101, 102, 103, 104, 105] + rng.integers(0, 50, size=100).tolist() + [101, 102, 103]
    wide = NgramDrafter(None, DrafterConfig(max_draft=2, overlay_tokens=0))
    narrow = NgramDrafter(None, DrafterConfig(max_draft=2, overlay_tokens=0, context_window=60))
    assert list(wide.propose(ctx, 2).tokens) == [104, 105]
    assert 104 not in list(narrow.propose(ctx, 2).tokens)
