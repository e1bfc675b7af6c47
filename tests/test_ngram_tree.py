"""Token trees from the drafter (ngram/tree.py, NgramDrafter with tree=True): laid out as ngram.draft
says, within the budget, holding every source's continuation, and scored by the replay's rule."""
from __future__ import annotations

from ngram.drafter import DrafterConfig, NgramDrafter
from ngram.replay import tree_accepted
from ngram.tree import merge


def test_merge_adds_where_continuations_depart():
    tokens, confs, parents = merge("abc", [1.0, 0.9, 0.8], [("abd", [1.0, 0.9, 0.5]), ("xy", [0.4, 0.3])], 10)
    assert tokens == "abcdxy"
    assert parents == [-1, 0, 1, 1, -1, 4]
    assert confs == [1.0, 0.9, 0.8, 0.5, 0.4, 0.3]


def test_merge_keeps_the_budget_and_returns_none_when_nothing_is_added():
    tokens, _, parents = merge("ab", [1.0, 1.0], [("xyz", [0.9, 0.9, 0.9])], 4)
    assert tokens == "abxy" and parents == [-1, 0, -1, 2]
    assert merge("ab", [1.0, 1.0], [("a", [1.0]), ("ab", [1.0, 1.0])], 8) is None
    assert merge("abcd", [1.0] * 4, [("x", [1.0])], 4) is None  # the main chain fills the budget


def _valid_layout(draft) -> bool:
    parents = draft.parents
    chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
    return chain >= 1 and all(-1 <= p < j for j, p in enumerate(parents)) and len(parents) == len(draft.tokens)


def test_the_drafter_branches_to_another_sources_continuation():
    drafter = NgramDrafter(None, DrafterConfig(max_draft=16, tree=True))
    first = drafter.session()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    first.propose(prompt, 4)
    first.finish(prompt + [20, 21, 22, 23, 24, 25])  # the overlay now continues 5 6 7 8 with 20 21 ..
    context = [9, 9, 5, 6, 7, 8, 30, 31, 32, 33, 9, 9, 5, 6, 7, 8]  # the context continues it with 30 31 ..
    draft = drafter.session().propose(context, 16)
    assert draft.parents is not None and _valid_layout(draft) and len(draft) <= 16
    tokens, parents = list(map(int, draft.tokens)), list(draft.parents)
    assert tree_accepted(tokens, parents, [30, 31, 32, 33]) >= 4
    assert tree_accepted(tokens, parents, [20, 21, 22, 23]) >= 4
    chains = NgramDrafter(None, DrafterConfig(max_draft=12, tree=False))
    assert chains.session().propose(context, 12).parents is None
