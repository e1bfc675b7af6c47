"""The C kernels (ngram/_speedups.c) return exactly what their Python twins return: same strings, same
floats bit for bit, same order, on random inputs built to hit every branch (repeats, ties, rows that
end early, every string kind). Skipped only where the extension was not built."""
import os
import random

import pytest

from ngram import codec, match
from ngram.codec import encode


def _installed_with_a_compiler() -> bool:
    import importlib.metadata
    import shutil

    try:
        importlib.metadata.distribution("sailfish")
    except importlib.metadata.PackageNotFoundError:
        return False
    return shutil.which("cc") is not None or shutil.which("gcc") is not None


def test_the_extension_is_built_where_the_install_had_a_compiler():
    """The build is optional (the install succeeds without a compiler), so a broken build would
    otherwise go unnoticed: slower drafts, every other test green."""
    if not _installed_with_a_compiler():
        pytest.skip("not pip-installed here, or no C compiler")
    import ngram._speedups  # noqa: F401


@pytest.fixture
def speedups():
    return pytest.importorskip("ngram._speedups")

# token ids whose code points fall in each string kind: latin-1, UCS-2, UCS-4, around the surrogate shift
ALPHABETS = [[0, 1, 2, 3], [5, 300, 0xD7FE, 0xD7FF, 0xD800], [70_000, 70_001, 262_143, 1, 2]]


def _text(rng: random.Random, n: int, alphabet: list[int]) -> str:
    return encode([rng.choice(alphabet) for _ in range(n)])


@pytest.mark.parametrize("seed", range(40))
def test_walk_matches_python(seed, speedups):
    rng = random.Random(seed)
    alphabet = rng.choice(ALPHABETS)
    depth = rng.randrange(0, 4)
    prefix = _text(rng, depth, alphabet)
    rows = [(prefix + _text(rng, rng.randrange(1, 12), alphabet), rng.randrange(1, 6))
            for _ in range(rng.randrange(1, 20))]
    rows.sort()
    if seed % 5 == 0:
        rng.shuffle(rows)  # not a caller's input, but the port is exact even so
    for max_tokens in (0, 1, 3, 16):
        for cutoff in (0.0, 0.3, 0.9):
            want = match.PYTHON_TWINS["walk"](list(rows), depth, max_tokens, cutoff)
            assert speedups.walk(list(rows), depth, max_tokens, cutoff) == want


@pytest.mark.parametrize("seed", range(40))
def test_context_match_and_rows_match_python(seed, speedups):
    rng = random.Random(seed)
    alphabet = rng.choice(ALPHABETS)[: rng.randrange(2, 5)]
    text = _text(rng, rng.randrange(0, 300), alphabet)
    for min_len, max_len, occ, start, hint in [(2, 16, 8, 0, None), (1, 4, 3, 10, None), (3, 32, 1, 0, 5),
                                               (2, 16, 8, len(text) // 2, 7), (5, 2, 8, 0, None)]:
        want = match.PYTHON_TWINS["context_match"](text, min_len, max_len, occ, start, hint)
        assert speedups.context_match(text, min_len, max_len, occ, start, hint) == want
        k, starts = want
        for ahead in (0, 1, 32):
            assert speedups.context_rows(text, starts, k, ahead) == match.PYTHON_TWINS["context_rows"](text, starts, k, ahead)


@pytest.mark.parametrize("seed", range(30))
def test_overlay_rows_matches_python(seed, speedups):
    from ngram.overlay import _MAX_CANDIDATES, KEY_TOKENS, SEPARATOR, Overlay

    rng = random.Random(seed)
    alphabet = rng.choice(ALPHABETS)[: rng.randrange(2, 4)]
    overlay = Overlay(max_tokens=4096)
    for _ in range(rng.randrange(1, 12)):
        overlay.add(_text(rng, rng.randrange(4, 60), alphabet))
    for _ in range(10):
        tail = _text(rng, rng.randrange(3, 30), alphabet)
        offsets = overlay._after.get(tail[-KEY_TOKENS:], [])
        for min_match, max_match, occ, cand, ahead in [(3, 16, 8, _MAX_CANDIDATES, 32), (5, 8, 2, 4, 3), (3, 64, 1, 1, 0)]:
            args = (overlay._text, offsets, tail, KEY_TOKENS, min_match, max_match, occ, cand, ahead, SEPARATOR)
            assert speedups.overlay_rows(*args) == match.PYTHON_TWINS["overlay_rows"](*args)


@pytest.mark.parametrize("seed", range(20))
def test_follow_rows_matches_python(seed, speedups):
    rng = random.Random(seed)
    alphabet = rng.choice(ALPHABETS)[:2]
    rows = sorted((_text(rng, rng.randrange(1, 10), alphabet), i) for i in range(rng.randrange(0, 12)))
    for depth in range(0, 4):
        for n in range(0, 4):
            appended = _text(rng, n, alphabet)
            got = speedups.follow_rows(rows, depth, appended)
            assert got == match.PYTHON_TWINS["follow_rows"](rows, depth, appended)


def test_codec_matches_python(speedups):
    ids = [0, 1, 0xD7FE, 0xD7FF, 0xD800, 65_535, 262_143, codec.MAX_TOKEN_ID]
    assert speedups.encode_ints(ids) == codec.PYTHON_TWINS["encode_ints"](ids)
    assert speedups.encode_ints([]) == ""
    text = speedups.encode_ints(ids)
    assert speedups.decode(text) == codec.PYTHON_TWINS["decode"](text) == ids
    for bad in ([-1], [codec.MAX_TOKEN_ID + 1]):
        with pytest.raises(ValueError, match="token id out of range"):
            speedups.encode_ints(bad)


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint32", "uint16", "int8", "uint64"])
def test_encode_buffer_matches_python(dtype, speedups):
    import numpy as np

    ids = np.random.default_rng(0).integers(0, 127 if dtype == "int8" else 65_536 if dtype == "uint16" else 262_144, 500)
    arr = ids.astype(dtype)
    want = codec.PYTHON_TWINS["encode_ints"](ids.tolist())
    assert speedups.encode_buffer(arr) == want == codec.encode(arr) == codec.PYTHON_TWINS["encode"](arr)
    assert speedups.encode(arr) == speedups.encode(ids.tolist()) == speedups.encode(tuple(ids.tolist())) == want
    assert speedups.encode_buffer(arr[::-3]) == codec.PYTHON_TWINS["encode_ints"](ids[::-3].tolist())
    assert speedups.encode_buffer(arr[:0]) == ""
    for bad in (np.array([-1]), np.array([codec.MAX_TOKEN_ID + 1]), np.array([2**63], dtype=np.uint64)):
        with pytest.raises(ValueError, match="token id out of range"):
            speedups.encode_buffer(bad)
    with pytest.raises(TypeError):
        speedups.encode_buffer(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError):
        speedups.encode_buffer(np.zeros(3, dtype=np.float32))


def test_bad_rows_raise_instead_of_crashing(speedups):
    with pytest.raises(TypeError):
        speedups.walk([("ab", 1), "not a row"], 0, 4, 0.3)
    with pytest.raises(IndexError):  # rows must be longer than the depth walked (Python raises too)
        speedups.walk([("ab", 1), ("ac", 1)], 2, 4, 0.3)
    with pytest.raises(IndexError):
        match.PYTHON_TWINS["walk"]([("ab", 1), ("ac", 1)], 2, 4, 0.3)
    with pytest.raises(ValueError):
        speedups.walk([("ab", 1)], -1, 4, 0.3)
    with pytest.raises(ValueError):
        speedups.follow_rows([("ab", 1)], -1, "a")
    with pytest.raises(TypeError):
        speedups.follow_rows([(1, 2)], 0, "a")


def test_the_package_uses_the_c_kernels_when_built(speedups):
    if os.environ.get("SAILFISH_PURE_PYTHON"):
        pytest.skip("SAILFISH_PURE_PYTHON forces the Python twins")
    assert match.walk is speedups.walk and codec.decode is speedups.decode


_REPLAY_SCRIPT = """
import json, sys
import numpy as np
from ngram.drafter import DrafterConfig, NgramDrafter
from ngram.index_file import BuildParams, load_index, write_index
from ngram.replay import replay_turn, ReplayStats

rng = np.random.default_rng(7)
turns = [rng.integers(0, 40, size=60).tolist() for _ in range(60)]
turns += [t[:30] + rng.integers(70_000, 70_004, size=20).tolist() for t in turns[:10]]  # a wider string kind
gen = write_index(sys.argv[1], [np.asarray(t, dtype=np.uint32) for t in turns[:50]], "fp", BuildParams())
drafter = NgramDrafter(load_index(gen), DrafterConfig())
out = []

class Recording:  # records every draft the real drafter proposes during the replay
    def session(self):
        inner = drafter.session()
        class S:
            def propose(self, ctx, k):
                d = inner.propose(ctx, k)
                out.append([list(map(int, d.tokens)), [float(c) for c in d.confidence], d.source, d.match_length])
                return d
            def prepare(self, *a): inner.prepare(*a)
            def feedback(self, *a): inner.feedback(*a)
            def finish(self, *a): inner.finish(*a)
        return S()

stats = ReplayStats()
for t in turns[50:]:
    replay_turn(Recording(), np.asarray(t[:20]), np.asarray(t[20:]), 16, stats)
print(json.dumps(out))
"""


def test_drafts_are_the_same_with_and_without_the_c_kernels(tmp_path, speedups):
    """End to end: a replay through index, context and overlay drafts the same tokens, confidences,
    sources and match lengths whether the C kernels or their Python twins run."""
    import json
    import subprocess
    import sys

    runs = {}
    for label, pure in (("c", ""), ("python", "1")):
        env = {**os.environ, "SAILFISH_PURE_PYTHON": pure}
        if not pure:
            env.pop("SAILFISH_PURE_PYTHON")
        done = subprocess.run([sys.executable, "-c", _REPLAY_SCRIPT, str(tmp_path / label)], env=env,
                              capture_output=True, text=True, check=True)
        runs[label] = json.loads(done.stdout)
    assert runs["c"] == runs["python"]
    assert {d[2] for d in runs["c"]} >= {"index", "context", "overlay"} and len(runs["c"]) > 200
