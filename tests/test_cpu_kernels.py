"""The CPU path's C kernels (server/_cpu_kernels.c): quantize_rows exactly as the numpy Q8_0 rule,
matmul_q8 and attention close to float64 references of the same definitions, and, bit for bit, the
same rows whatever the batch size M, the thread count, and the code path (scalar, AVX2, AVX-VNNI,
AVX-512 VNNI: matmul_q8's stated arithmetic exactly on each; the server checks a
16-token draft in one call against the logits 16 one-token calls would give). Skipped only where the
extension was not built."""
import numpy as np
import pytest

ck = pytest.importorskip("server._cpu_kernels")
from server import cpu_kernels  # noqa: E402  (the numpy twins)


@pytest.fixture
def scalar():
    """Run the portable scalar code inside the test (restored after)."""
    prev = ck._force_scalar(True)
    yield
    ck._force_scalar(prev)


def _quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    d = np.abs(b).max(axis=-1) / np.float32(127)
    safe = np.where(d == 0, np.float32(1), d)[..., None]
    q = np.where(d[..., None] == 0, np.float32(0), np.clip(np.rint(b / safe), -127, 127))
    return q.astype(np.int8).reshape(m, k), d.astype(np.float32)


def _weights(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    wq = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
    ws = (rng.random((n, k // 32), dtype=np.float32) * 0.02).astype(np.float32)
    return wq, ws


def _matmul(xq, xs, wq, ws, **kw) -> np.ndarray:
    out = np.empty((xq.shape[0], wq.shape[0]), np.float32)
    assert ck.matmul_q8(xq, xs, wq, ws, out, **kw) is out
    return out


def _matmul_ref(xq, xs, wq, ws) -> np.ndarray:
    m, k = xq.shape
    n = wq.shape[0]
    idot = np.einsum("mbi,nbi->mnb", xq.reshape(m, k // 32, 32).astype(np.int64),
                     wq.reshape(n, k // 32, 32).astype(np.int64))
    return np.einsum("mnb,mb,nb->mn", idot.astype(np.float64), xs.astype(np.float64), ws.astype(np.float64))


def test_quantize_rows_matches_the_q8_0_rule_exactly():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 640)) * rng.uniform(0.01, 50, size=(7, 1))).astype(np.float32)
    x[1, 32:64] = 0  # a zero block: d = 0, all codes 0
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves: ties round to even
    x[3, 64:96] = -3.0  # a block at its own maximum: codes -127
    for forced in (False, True):
        prev = ck._force_scalar(forced)
        try:
            xq, xs = ck.quantize_rows(x)
        finally:
            ck._force_scalar(prev)
        rq, rs = _quantize_ref(x)
        assert xq.dtype == np.int8 and xs.dtype == np.float32 and xq.shape == (7, 640) and xs.shape == (7, 20)
        assert np.array_equal(xq, rq) and np.array_equal(xs, rs)
        assert not xq[1, 32:64].any() and xs[1, 1] == 0 and (xq[3, 64:96] == -127).all()


@pytest.mark.parametrize("m,n,k", [(5, 64, 640), (3, 37, 96), (2, 12, 2048)])  # N % 4 != 0; K/32 % 8 != 0
def test_matmul_q8_is_the_block_scaled_dot_product(m, n, k):
    rng = np.random.default_rng(1)
    xq, xs = ck.quantize_rows(rng.standard_normal((m, k)).astype(np.float32))
    wq, ws = _weights(rng, n, k)
    ref = _matmul_ref(xq, xs, wq, ws)
    np.testing.assert_allclose(_matmul(xq, xs, wq, ws), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _matmul_def(xq, xs, wq, ws) -> np.ndarray:
    """The module's definition of out[m, n] in numpy float32, operation for operation: d(b) exact,
    acc[b % 4] = fmaf(xs * ws, d, acc) (fma through float64: the product of a float32 scale and a
    dot below 2**24 is exact there and the sum is rounded once, except on a double-rounding tie,
    absent here), then (acc0 + acc1) + (acc2 + acc3)."""
    m, k = xq.shape
    n, nb = wq.shape[0], k // 32
    d = np.einsum("mbi,nbi->mnb", xq.reshape(m, nb, 32).astype(np.int64),
                  wq.reshape(n, nb, 32).astype(np.int64)).astype(np.float32)
    s = xs[:, None, :] * ws[None, :, :]  # float32 products, rounded
    acc = np.zeros((4, m, n), np.float32)
    for b in range(nb):
        acc[b % 4] = (s[:, :, b].astype(np.float64) * d[:, :, b].astype(np.float64)
                      + acc[b % 4].astype(np.float64)).astype(np.float32)
    return (acc[0] + acc[1]) + (acc[2] + acc[3])


def _packed(wq, ws) -> np.ndarray:
    out = np.empty(ck.packed_size(*wq.shape), np.uint8)
    assert ck.pack_q8(wq, ws, out) is out
    return out


def test_matmul_q8_is_its_stated_arithmetic_on_every_path():
    rng = np.random.default_rng(7)
    for m, n, k in [(5, 12, 640), (3, 9, 96), (17, 7, 32), (2, 5, 2048)]:  # K/32 = 20, 3, 1, 64
        xq, xs = ck.quantize_rows(rng.standard_normal((m, k)).astype(np.float32))
        wq, ws = _weights(rng, n, k)
        want = _matmul_def(xq, xs, wq, ws)
        for path in ck.paths():
            prev = ck._force_path(path)
            try:
                assert np.array_equal(_matmul(xq, xs, wq, ws), want), path
                assert np.array_equal(_matmul(xq, xs, wq, ws, packed=_packed(wq, ws)), want), path
            finally:
                ck._force_path(prev)


@pytest.mark.parametrize("k", [32, 64, 96, 640, 2048])
@pytest.mark.parametrize("n", [1, 6, 37, 64])  # N % 4 != 0 and N below one tile stride
def test_every_path_gives_the_same_bits_for_every_m_and_thread_count(n, k):
    """M = 1..17, threads 1, 2, 3, all four paths, packed and not: one set of bits (the scalar
    code's on all 17 rows), which the numpy twin gives too; and close to a float64 reference."""
    from server import cpu_kernels

    rng = np.random.default_rng(n * 1000 + k)
    xq, xs = ck.quantize_rows((rng.standard_normal((17, k)) * rng.uniform(0.1, 10, (17, 1))).astype(np.float32))
    wq, ws = _weights(rng, n, k)
    packed = _packed(wq, ws)
    prev = ck._force_path("scalar")
    try:
        want = _matmul(xq, xs, wq, ws, threads=1)
    finally:
        ck._force_path(prev)
    for path in ck.paths():
        prev = ck._force_path(path)
        try:
            for m in range(1, 18):
                for threads in (1, 2, 3):
                    got = _matmul(xq[:m], xs[:m], wq, ws, threads=threads, packed=packed)
                    assert np.array_equal(got, want[:m]), (path, m, threads)
                assert np.array_equal(_matmul(xq[17 - m:], xs[17 - m:], wq, ws), want[17 - m:]), (path, m)
        finally:
            ck._force_path(prev)
    assert np.array_equal(_matmul(xq, xs, wq, ws, packed=packed), want)  # unforced (M = 1 may pick its own path)
    assert np.array_equal(_matmul(xq[4:5], xs[4:5], wq, ws, packed=packed), want[4:5])
    # the numpy twin's definition, the same bits (it quantizes x itself: give it x that quantizes to xq, xs)
    x = (xq.reshape(17, -1, 32).astype(np.float32) * xs[:, :, None]).reshape(17, k)
    xq2, xs2 = ck.quantize_rows(x)
    twin = cpu_kernels._linear_numpy(x, wq, ws)
    assert np.array_equal(twin, _matmul(xq2, xs2, wq, ws, packed=packed))
    ref = _matmul_ref(xq, xs, wq, ws)
    np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_fma32_rounds_once():
    """The numpy twin's fmaf: exactly one rounding of a * b + c, including where float64's own
    rounding of the sum lands on a float32 tie (double rounding would then round wrong)."""
    from server.cpu_kernels import fma32

    # 1 + 2^-30 -> 1; 15 - 15 -> +0; (1 + 2^-23) + (2^-24 - 2^-54): just below the tie between
    # 1 + 2^-23 and 1 + 2^-22, which float64 rounds onto (and then to even, 1 + 2^-22: wrong)
    a = np.array([1.0, 3.0, 1.0 + 2.0**-15], np.float32)
    b = np.array([1.0, 5.0, (1.0 - 2.0**-15) * 2.0**-24], np.float32)
    c = np.array([2.0**-30, -15.0, 1.0 + 2.0**-23], np.float32)
    want = np.array([1.0, 0.0, 1.0 + 2.0**-23], np.float32)
    naive = (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)
    assert naive[2] == np.float32(1.0 + 2.0**-22)  # the double rounding this guards against
    got = fma32(a, b, c)
    assert np.array_equal(got, want) and not np.signbit(got[1]), got
    assert fma32(-a, b, -c)[2] == -want[2]


def test_pack_q8_layout_and_checks():
    rng = np.random.default_rng(9)
    wq, ws = _weights(rng, 5, 160)  # 2 tiles (the second padded), 2 groups (the second padded)
    p = _packed(wq, ws)
    assert p.shape == (ck.packed_size(5, 160),) == (2 * 2 * 576,)
    rec = p[:576]  # tile 0, group 0
    for r, q, t, i in [(0, 0, 0, 0), (3, 2, 7, 3), (1, 3, 4, 1)]:
        assert rec[64 * t + 16 * r + 4 * q + i] == (int(wq[r, 32 * q + 4 * t + i]) + 128)
    assert np.array_equal(rec[512:].view(np.float32).reshape(4, 4), ws[:4, :4])
    last = p[3 * 576:]  # tile 1, group 1: row 4's block 4, the rest padding
    assert last[512:].view(np.float32)[0] == ws[4, 4] and not last[512:].view(np.float32)[1:].any()
    with pytest.raises(ValueError, match="packed_size"):
        ck.pack_q8(wq, ws, np.empty(10, np.uint8))
    with pytest.raises(ValueError, match="packed must be"):
        xq, xs = ck.quantize_rows(np.ones((1, 160), np.float32))
        ck.matmul_q8(xq, xs, wq, ws, np.empty((1, 5), np.float32), packed=p[:-1])
    with pytest.raises(TypeError, match="packed must be uint8"):
        ck.matmul_q8(xq, xs, wq, ws, np.empty((1, 5), np.float32), packed=p.view(np.int8))


@pytest.mark.parametrize("n,k", [(260, 640), (1030, 352), (37, 96)])  # K/32 = 20, 11 (odd), 3
def test_matmul_q8_rows_are_the_same_for_any_batch_thread_count_and_path(n, k):
    rng = np.random.default_rng(2)
    xq, xs = ck.quantize_rows(rng.standard_normal((64, k)).astype(np.float32))
    wq, ws = _weights(rng, n, k)
    prev = ck._force_path("scalar")
    try:
        assert ck.simd() == "scalar"
        want = _matmul(xq, xs, wq, ws, threads=2)  # the scalar code, 64 rows
        rows = np.concatenate([_matmul(xq[i:i + 1], xs[i:i + 1], wq, ws, threads=1) for i in range(64)])
        assert np.array_equal(rows, want)
    finally:
        ck._force_path(prev)
    assert "scalar" in ck.paths() and ck.simd() == ck.paths()[-1]
    for path in ck.paths():
        prev = ck._force_path(path)
        try:
            assert ck.simd() == path
            for lo, hi in [(0, 16), (0, 64), (5, 8), (9, 10)]:  # M = 16, 64, 3, 1
                for threads in range(1, 6):
                    assert np.array_equal(_matmul(xq[lo:hi], xs[lo:hi], wq, ws, threads=threads), want[lo:hi]), \
                        (path, lo, hi, threads)
            rows = np.concatenate([_matmul(xq[i:i + 1], xs[i:i + 1], wq, ws, threads=2) for i in range(16)])
            assert np.array_equal(rows, want[:16]), path
        finally:
            ck._force_path(prev)
    assert np.array_equal(_matmul(xq[3:7], xs[3:7], wq, ws), want[3:7])  # unforced, the module's threads
    assert np.array_equal(_matmul(xq[5:6], xs[5:6], wq, ws), want[5:6])


def test_force_path_and_force_scalar():
    assert ck._force_path(None) is None
    assert ck._force_scalar(True) is False
    assert ck.simd() == "scalar" and ck._force_path(None) == "scalar"
    assert ck._force_scalar(False) is False and ck.simd() == ck.paths()[-1]
    with pytest.raises(ValueError, match="unknown path"):
        ck._force_path("neon")
    with pytest.raises(TypeError):
        ck._force_path(3)
    for path in ("avx2", "avxvnni", "avx512"):
        if path not in ck.paths():
            with pytest.raises(ValueError, match="cannot run"):
                ck._force_path(path)
    assert ck.simd() == ck.paths()[-1]


def test_set_threads_is_the_default_for_calls():
    prev = ck.set_threads(3)
    try:
        assert ck.get_threads() == 3
        rng = np.random.default_rng(3)
        xq, xs = ck.quantize_rows(rng.standard_normal((2, 64)).astype(np.float32))
        wq, ws = _weights(rng, 40, 64)
        assert np.array_equal(_matmul(xq, xs, wq, ws), _matmul(xq, xs, wq, ws, threads=1))
    finally:
        ck.set_threads(prev)
    with pytest.raises(ValueError, match="1..64"):
        ck.set_threads(0)


def _attention(q, k, v, positions, window, scale, **kw) -> np.ndarray:
    out = np.empty_like(q)
    assert ck.attention(q, k, v, positions, window, scale, out, **kw) is out
    return out


def _attention_ref(q, k, v, positions, window, scale) -> np.ndarray:
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    out = np.empty_like(q)
    for m, pos in enumerate(positions):
        start = max(0, pos - window + 1) if window > 0 else 0
        s = q[m] @ k[start:pos + 1].T * scale
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        out[m] = (e / e.sum(axis=-1, keepdims=True)) @ v[start:pos + 1]
    return out


def _cache(rng, m=16, h=4, d=256, t=300):
    """Queries (float32) and a float16 K/V cache, as server.cpu_model keeps it."""
    q = rng.standard_normal((m, h, d)).astype(np.float32)
    k = rng.standard_normal((t, d)).astype(np.float16)
    v = rng.standard_normal((t, d)).astype(np.float16)
    return q, k, v


@pytest.mark.parametrize("window", [0, 64])
def test_attention_is_causal_softmax_attention(window):
    rng = np.random.default_rng(4)
    q, k, v = _cache(rng)
    positions = np.array([0, 1, 5, 63, 64, 65, 100, 150, 199, 200, 250, 251, 252, 297, 298, 299], np.int64)
    ref = _attention_ref(q, k, v, positions, window, 0.0625)
    batch = _attention(q, k, v, positions, window, 0.0625)
    np.testing.assert_allclose(batch, ref, rtol=1e-4, atol=1e-5)
    # rows far apart (pairs of rows with few or no keys in common): each row still its own bits
    for threads in (1, 2):
        rows = np.concatenate([_attention(q[i:i + 1], k, v, positions[i:i + 1], window, 0.0625, threads=threads)
                               for i in range(len(positions))])
        assert np.array_equal(_attention(q, k, v, positions, window, 0.0625, threads=threads), rows)


# D % 16 != 0 runs the scalar code throughout; D % 32 != 0 the AVX2 code where AVX-512 would run.
# t = 1300: rows over 1,024 keys or more are split between threads by keys and by values (D = 48: the
# values in a 32-wide and a 16-wide part).
@pytest.mark.parametrize("h,d,t", [(4, 256, 300), (3, 48, 300), (2, 20, 300), (4, 256, 1300), (2, 16, 1300),
                                   (4, 48, 1300)])
def test_attention_rows_are_the_same_for_any_batch_thread_count_and_path(h, d, t):
    rng = np.random.default_rng(5)
    q, k, v = _cache(rng, h=h, d=d, t=t)
    positions = np.arange(t - 120, t - 104, dtype=np.int64)  # a 16-token draft after the prefix
    for window in (0, 50, 1100):
        batch = _attention(q, k, v, positions, window, 0.1, threads=1)
        for threads in (1, 2, 3):
            rows = np.concatenate([_attention(q[i:i + 1], k, v, positions[i:i + 1], window, 0.1, threads=threads)
                                   for i in range(16)])
            assert np.array_equal(batch, rows)
        for threads in (2, 3, 7):  # 3 and 7 split a row's heads between threads
            assert np.array_equal(_attention(q, k, v, positions, window, 0.1, threads=threads), batch)
        for path in ck.paths():  # each path's attention code (AVX-512, AVX2, scalar)
            prev = ck._force_path(path)
            try:
                assert np.array_equal(_attention(q, k, v, positions, window, 0.1, threads=2), batch), path
                assert np.array_equal(_attention(q[:1], k, v, positions[:1], window, 0.1, threads=2), batch[:1]), path
            finally:
                ck._force_path(prev)
        np.testing.assert_allclose(batch, _attention_ref(q, k, v, positions, window, 0.1), rtol=1e-4, atol=1e-5)


def test_many_rows_over_a_long_cache_split_by_keys_and_values_keep_each_rows_bits():
    """Rows of a chain over 1,024 keys or more are split between threads by keys (the scores) and
    by output elements (the values), 16 rows at a time: 2..20 rows (a second group of 16 among
    them), with and without a window, on every path this CPU runs, equal to each row computed
    alone by one thread."""
    rng = np.random.default_rng(7)
    q, k, v = _cache(rng, m=20, t=2100)
    positions = np.arange(2000, 2020, dtype=np.int64)
    for window in (0, 1500):
        rows = np.concatenate([_attention(q[i:i + 1], k, v, positions[i:i + 1], window, 0.1, threads=1)
                               for i in range(20)])
        for path in ck.paths():  # each path's code (AVX-512, AVX2: the split; scalar: by rows)
            prev = ck._force_path(path)
            try:
                for m in (2, 5, 16, 20):
                    for threads in (2, 3):
                        got = _attention(q[:m], k, v, positions[:m], window, 0.1, threads=threads)
                        assert np.array_equal(got, rows[:m]), (path, m, threads)
            finally:
                ck._force_path(prev)
        np.testing.assert_allclose(rows, _attention_ref(q, k, v, positions, window, 0.1), rtol=1e-4, atol=1e-5)


def test_bad_arguments_raise_clear_errors():
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        ck.quantize_rows(np.zeros((2, 40), np.float32))
    with pytest.raises(TypeError, match="x must be float32, not float64"):
        ck.quantize_rows(x.astype(np.float64))
    with pytest.raises(TypeError, match="numpy array"):
        ck.quantize_rows([[0.0] * 32])
    with pytest.raises(ValueError, match="2-dimensional"):
        ck.quantize_rows(np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        ck.quantize_rows(np.zeros((64, 2), np.float32).T)
    xq, xs = ck.quantize_rows(x)
    wq, ws = np.zeros((8, 64), np.int8), np.zeros((8, 2), np.float32)
    out = np.empty((2, 8), np.float32)
    with pytest.raises(ValueError, match=r"got xq \[2, 64\], xs \[2, 2\], wq \[8, 64\], ws \[8, 2\], out \[2, 9\]"):
        ck.matmul_q8(xq, xs, wq, ws, np.empty((2, 9), np.float32))
    with pytest.raises(ValueError, match="shapes must be"):
        ck.matmul_q8(xq, xs, np.zeros((8, 96), np.int8), ws, out)
    with pytest.raises(TypeError, match="wq must be int8, not uint8"):
        ck.matmul_q8(xq, xs, wq.view(np.uint8), ws, out)
    with pytest.raises(ValueError, match="out must be a writable"):
        ro = np.empty((2, 8), np.float32)
        ro.flags.writeable = False
        ck.matmul_q8(xq, xs, wq, ws, ro)
    with pytest.raises(ValueError, match="threads must be 1..64"):
        ck.matmul_q8(xq, xs, wq, ws, out, threads=0)
    q, k, v = _cache(np.random.default_rng(6), m=2, t=10)
    pos = np.array([3, 9], np.int64)
    with pytest.raises(ValueError, match="positions\\[1\\] = 10 is outside the cache"):
        ck.attention(q, k, v, np.array([3, 10], np.int64), 0, 1.0, np.empty_like(q))
    with pytest.raises(TypeError, match="positions must be int64, not int32"):
        ck.attention(q, k, v, pos.astype(np.int32), 0, 1.0, np.empty_like(q))
    with pytest.raises(ValueError, match="shapes must be"):
        ck.attention(q, np.zeros((10, 128), np.float16), v, pos, 0, 1.0, np.empty_like(q))
    with pytest.raises(TypeError, match="k_cache must be float16, not float32"):
        ck.attention(q, k.astype(np.float32), v, pos, 0, 1.0, np.empty_like(q))
    with pytest.raises(ValueError, match="3-dimensional"):
        ck.attention(q[0], k, v, pos, 0, 1.0, np.empty_like(q))


def _random_tree(rng, m: int) -> list[int]:
    return [-1] + [int(rng.integers(0, j)) for j in range(1, m)]


@pytest.mark.parametrize("h,d", [(4, 256), (2, 20)])
def test_a_tree_row_equals_the_chain_row_of_its_path(h, d):
    """A token tree's row (its ancestors in the step's slots) gives, bit for bit, what the chain of
    its path gives at the same position: on every code path, with and without a window."""
    from server.cpu_model import tree_layout

    rng = np.random.default_rng(6)
    q, k, v = _cache(rng, m=24, h=h, d=d, t=300)
    start = 200
    parents = _random_tree(rng, 24)
    depth, ancestors = tree_layout(parents)
    for window in (0, 12, 50):
        for force_scalar in (False, True):
            prev = ck._force_scalar(force_scalar)
            try:
                tree = _attention(q, k, v, start + depth, window, 0.1, tree_start=start, ancestors=ancestors)
                for j in range(24):
                    path = [i for i in range(24) if int(ancestors[j]) >> i & 1]  # in depth order
                    chain_k, chain_v = k.copy(), v.copy()
                    chain_k[start:start + len(path)] = k[[start + i for i in path]]
                    chain_v[start:start + len(path)] = v[[start + i for i in path]]
                    row = _attention(q[j:j + 1], chain_k, chain_v, np.array([start + depth[j]]), window, 0.1)
                    assert np.array_equal(tree[j:j + 1], row), (window, j)
            finally:
                ck._force_scalar(prev)
        twin = cpu_kernels_numpy_attention(q, k, v, start + depth, window, 0.1, start, ancestors)
        np.testing.assert_allclose(twin, tree, rtol=1e-4, atol=1e-5)


def cpu_kernels_numpy_attention(q, k, v, positions, window, scale, tree_start, ancestors):
    from server import cpu_kernels

    return cpu_kernels._attention_numpy(q, k, v, positions, window, scale, np.empty_like(q), tree_start, ancestors)


def test_a_malformed_tree_is_refused():
    rng = np.random.default_rng(7)
    q, k, v = _cache(rng, m=2, h=1, d=32, t=40)
    with pytest.raises(ValueError, match="ancestors"):  # row 1 claims depth 1 but marks no parent
        _attention(q, k, v, np.array([10, 11]), 0, 0.1, tree_start=10, ancestors=np.array([1, 2], np.int64))
    with pytest.raises(ValueError, match="ancestors"):
        _attention(q, k, v, np.array([10, 11]), 0, 0.1, tree_start=39, ancestors=np.array([1, 3], np.int64))


def test_attention_many_gives_each_call_its_own_bits():
    """Several sequences' calls at once (a batched forward's): each out is what `attention` writes
    for that call alone, whichever calls run alone on every thread and which side by side (one
    far longer than the rest, calls of like size, a tree among them, one row over a long cache),
    at one thread or two; the wrapper returns them in order."""
    from server import cpu_kernels
    from server.cpu_model import tree_layout

    rng = np.random.default_rng(12)
    depth, ancestors = tree_layout(_random_tree(rng, 6))
    specs = [  # (rows, cache length, window, tree)
        [(5, 3000, 0, False), (5, 300, 0, False), (1, 200, 0, False)],      # the first outweighs the rest
        [(5, 600, 512, False), (5, 700, 512, False), (4, 650, 512, False), (6, 400, 512, True)],
        [(1, 2048, 0, False), (7, 1500, 0, False)],
        [(3, 100, 0, False)],
    ]
    for spec in specs:
        calls = []
        for m, t, window, tree in spec:
            q, k, v = _cache(rng, m=m, h=4, d=256, t=t)
            if tree:
                start = t - 10
                calls.append((q, k, v, start + depth, window, 0.07, start, ancestors))
            else:
                calls.append((q, k, v, np.arange(t - m, t, dtype=np.int64), window, 0.07))
        alone = [_attention(*c[:6], **({"tree_start": c[6], "ancestors": c[7]} if len(c) > 6 else {})) for c in calls]
        for threads in (1, 2):
            outs = [np.full_like(c[0], np.nan) for c in calls]
            assert ck.attention_many([(*c[:6], o, *c[6:]) for c, o in zip(calls, outs)], threads=threads) is None
            for a, o in zip(alone, outs):
                assert np.array_equal(a, o), (spec, threads)
        for a, o in zip(alone, cpu_kernels.attention_many(calls)):
            assert np.array_equal(a, o), spec


def test_attention_many_refuses_a_bad_call_with_its_index():
    rng = np.random.default_rng(13)
    q, k, v = _cache(rng, m=2, h=1, d=32, t=40)
    good = (q, k, v, np.array([10, 11]), 0, 0.1, np.empty_like(q))
    with pytest.raises(TypeError, match=r"calls\[1\] must be a tuple"):
        ck.attention_many([good, [q, k, v]])
    with pytest.raises(ValueError, match="outside the cache"):
        ck.attention_many([good, (q, k, v, np.array([10, 40]), 0, 0.1, np.empty_like(q))])
    with pytest.raises(TypeError):
        ck.attention_many([good, (q, k)])
    with pytest.raises(TypeError, match="sequence"):
        ck.attention_many(5)
    assert ck.attention_many([]) is None


def test_every_float16_in_the_cache_reads_as_its_exact_value():
    """The scalar code's float16 conversion and F16C's agree on every finite float16 (subnormals and
    signed zeros included): attention over a cache holding them all gives the same bits both ways."""
    halves = np.arange(2**16, dtype=np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)]
    d = 256
    t = len(finite) // d
    k = finite[: t * d].reshape(t, d) * np.float16(1e-4)  # keeps the scores small
    v = finite[: t * d].reshape(t, d)
    q = np.random.default_rng(9).standard_normal((4, 2, d)).astype(np.float32) * np.float32(1e-3)
    positions = np.array([t - 4, t - 3, t - 2, t - 1], np.int64)
    simd = _attention(q, k, v, positions, 0, 1.0)
    prev = ck._force_scalar(True)
    try:
        scalar = _attention(q, k, v, positions, 0, 1.0)
    finally:
        ck._force_scalar(prev)
    assert np.array_equal(simd, scalar)
    assert np.array_equal(v.astype(np.float32).astype(np.float16), v)  # float16 -> float32 is exact


@pytest.mark.parametrize("n", [640, 256, 20])
def test_rms_norm_is_rmsnorm_each_row_on_its_own(n):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((16, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    res = rng.standard_normal((16, n)).astype(np.float32)
    for weight, residual in ((w, None), (None, None), (w, res), (None, res)):
        out = np.empty_like(x)
        got = ck.rms_norm(x, weight, 1e-6, out, residual)
        assert got is out
        x64 = x.astype(np.float64)
        ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * (1.0 if weight is None else weight)
        ref = ref if residual is None else residual + ref
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        twin = cpu_kernels.rms_norm_numpy(x, weight, 1e-6, residual)
        np.testing.assert_allclose(out, twin, rtol=1e-5, atol=1e-5)
        for i in (0, 7, 15):  # a row alone gives the same bits
            one = np.empty_like(x[i:i + 1])
            ck.rms_norm(x[i:i + 1], weight, 1e-6, one, None if residual is None else residual[i:i + 1])
            assert np.array_equal(one, out[i:i + 1])
        for path in ck.paths():  # each path's code gives the same bits
            prev = ck._force_path(path)
            try:
                assert np.array_equal(ck.rms_norm(x, weight, 1e-6, np.empty_like(x), residual), out), path
            finally:
                ck._force_path(prev)
    inplace = res.copy()
    ck.rms_norm(x, w, 1e-6, inplace, inplace)  # out may be the residual itself
    assert np.array_equal(inplace, ck.rms_norm(x, w, 1e-6, np.empty_like(x), res))
    with pytest.raises(ValueError, match="shapes"):
        ck.rms_norm(x, w[:-1], 1e-6, np.empty_like(x))
    with pytest.raises(TypeError):
        ck.rms_norm(x.astype(np.float64), w, 1e-6, np.empty_like(x))


@pytest.mark.parametrize("n", [2048, 37])
def test_gelu_mul_is_gelu_tanh_times_up_on_every_path(n):
    rng = np.random.default_rng(12)
    gate_up = (rng.standard_normal((16, 2 * n)) * np.array([0.01, 1, 5, 60])[rng.integers(0, 4, (16, 2 * n))]).astype(np.float32)
    gate_up[0, :4] = [0.0, -0.0, 1e-30, -1e-30]
    fused = ck.gelu_mul(gate_up, None, np.empty((16, n), np.float32))
    split = ck.gelu_mul(np.ascontiguousarray(gate_up[:, :n]), np.ascontiguousarray(gate_up[:, n:]), np.empty((16, n), np.float32))
    assert np.array_equal(fused, split)
    g = gate_up[:, :n].astype(np.float64)
    ref = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * gate_up[:, n:]
    np.testing.assert_allclose(fused, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fused, cpu_kernels.gelu_mul_numpy(gate_up), rtol=1e-6, atol=1e-6)
    one = ck.gelu_mul(gate_up[3:4], None, np.empty((1, n), np.float32))
    assert np.array_equal(one, fused[3:4])  # a row alone gives the same bits
    for path in ck.paths():
        prev = ck._force_path(path)
        try:
            assert np.array_equal(ck.gelu_mul(gate_up, None, np.empty((16, n), np.float32)), fused), path
        finally:
            ck._force_path(prev)
    with pytest.raises(ValueError, match="shapes"):
        ck.gelu_mul(gate_up, None, np.empty((16, n + 1), np.float32))


def test_rope_gives_numpys_bits():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((5, 4, 256)).astype(np.float32)
    cos, sin = (rng.standard_normal((5, 256)).astype(np.float32) for _ in range(2))
    got = ck.rope(x, cos, sin, np.empty_like(x))
    half = 128
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    assert np.array_equal(got, x * cos[:, None] + rotated * sin[:, None])
    assert np.array_equal(got, cpu_kernels.rope_numpy(x, cos, sin))
    with pytest.raises(ValueError, match="shapes"):
        ck.rope(x, cos[:4], sin, np.empty_like(x))
