"""The drafter's interfaces: every session type has the whole DrafterSession protocol (finish
included), and every source (index, context, overlay) honours its bound."""
import numpy as np
import pytest

from ngram.codec import encode
from ngram.draft import DrafterSession
from ngram.drafter import DrafterConfig, NgramDrafter, PromptLookupDrafter
from ngram.index_file import BuildParams, load_index, write_index
from index.peers import _SuffixSession
from ngram.sources import ContextSource, IndexSource, OverlaySource


def _index(tmp_path, turns):
    write_index(tmp_path, [np.array(t, dtype=np.uint32) for t in turns], "fp", BuildParams())
    return load_index(tmp_path, "fp")


def test_every_session_type_has_the_whole_protocol(tmp_path):
    idx = _index(tmp_path, [[1, 2, 3, 4, 5, 6]])
    sessions = [NgramDrafter(idx).session(), NgramDrafter(None).session(), PromptLookupDrafter().session()]
    for session in sessions:
        for name in ("propose", "feedback", "finish"):
            assert callable(getattr(session, name)), (type(session).__name__, name)
        session.propose([1, 2, 3], 4)
        session.finish([1, 2, 3, 4])
        session.finish()
    for name in ("propose", "feedback", "finish"):  # the SuffixDecoding peer (arctic-inference may be absent)
        assert callable(getattr(_SuffixSession, name))
    assert {"propose", "feedback", "finish"} <= set(dir(DrafterSession))


class _Checked:
    """Wraps a source: before each search, its bound is asked (twice: it must not change state),
    and the search must not return a longer match than the bound said."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log
        self.name = inner.name

    def bound(self, text, seen):
        return self.inner.bound(text, seen)

    def search(self, text, seen):
        bound = self.inner.bound(text, seen)
        assert self.inner.bound(text, seen) == bound
        k = self.inner.search(text, seen)
        assert 0 <= k <= bound, (self.name, k, bound)
        self.log.append((self.name, k, bound))
        return k

    def draft(self, text, k, max_tokens):
        drafted, confs = self.inner.draft(text, k, max_tokens)
        assert len(drafted) <= max_tokens and len(confs) == len(drafted)
        assert all(a >= b for a, b in zip(confs, confs[1:]))  # cumulative confidences only fall
        return drafted, confs

    def reset(self):
        self.inner.reset()

    def shift(self, dropped):
        self.inner.shift(dropped)

    def prepare(self, text):
        self.inner.prepare(text)

    def finish(self, text):
        self.inner.finish(text)


@pytest.mark.parametrize("window", [4096, 24])  # 24: the text is cut back (shift) again and again
def test_every_source_honours_its_bound(tmp_path, window):
    rng = np.random.default_rng(3)
    turns = [rng.integers(0, 30, size=40).tolist() for _ in range(30)]
    drafter = NgramDrafter(_index(tmp_path, turns), DrafterConfig(context_window=window))
    for turn in turns[10:16]:  # served completions (a session whose text was cut back adds none)
        drafter.overlay.add(encode(turn))
    log = []
    for r in range(14):
        session = drafter.session()
        assert [type(s) for s in session._sources] == [IndexSource, ContextSource, OverlaySource]
        session._sources = [_Checked(s, log) for s in session._sources]
        base = turns[r % 16]
        ctx = rng.integers(0, 30, size=6).tolist()
        for _ in range(90):  # copy stretches of indexed turns and of the context itself, with noise
            draft = session.propose(ctx, int(rng.integers(1, 9)))
            roll = rng.random()
            if roll < 0.5:
                at = len(ctx) % len(base)
                ctx = ctx + base[at : at + int(rng.integers(1, 4))]
            elif roll < 0.8 and len(draft):
                accepted = int(rng.integers(0, len(draft) + 1))
                session.feedback(len(draft), accepted)
                ctx = ctx + list(draft.tokens[:accepted]) + [int(rng.integers(0, 30))]
            else:
                ctx = ctx + rng.integers(0, 30, size=int(rng.integers(1, 3))).tolist()
        if r < 8:  # fills the overlay (few enough completions that every candidate is examined)
            session.finish(ctx)
    found = {name for name, k, _ in log if k}
    assert found == {"index", "context", "overlay"}  # each source matched, and was checked, many times
    assert any(k == bound for _, k, bound in log)  # bounds are tight at times, not only safe
