"""The step kernels alone (server/small_m_matmul.py, server/step_attention.py) at every row count up
to 64: row i of a many-row call is bit-identical to the same row computed alone, and the results
are close to a float32 reference. CUDA only (skipped without a GPU); the fast path's whole-step
versions of these checks are in tests/test_fast_path.py."""
from __future__ import annotations

import pytest
import torch

from server.small_m_matmul import BLOCK_K, MAX_ROWS, SmallMLinear, pack_codes

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

ROW_COUNTS = (1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64)


def ring_positions(slots: int, end: int) -> torch.Tensor:
    """slot_pos of a ring of `slots` slots after positions 0..end-1 were written (slot = p % slots)."""
    out = torch.full((slots,), -1, dtype=torch.long)
    p = torch.arange(max(0, end - slots), end)
    out[p % slots] = p
    return out.cuda()


def attention_case(seed: int, slots: int, d: int, start: int, sliding: bool) -> tuple:
    """(k, v, q, attn, slot_pos): random bf16 caches of 2 KV heads x `slots` slots, MAX_ROWS queries
    of 4 heads each, a StepAttention for them, and the ring's positions after start + MAX_ROWS
    positions (None for a full layer)."""
    from server.step_attention import StepAttention

    kv_heads, group = 2, 4
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(kv_heads, slots, d, generator=g)).to(torch.bfloat16).cuda()
    v = (torch.randn(kv_heads, slots, d, generator=g)).to(torch.bfloat16).cuda()
    q = (torch.randn(MAX_ROWS, kv_heads * group, d, generator=g)).to(torch.bfloat16).cuda()
    attn = StepAttention(kv_heads, group, d, slots, MAX_ROWS, "cuda")
    return k, v, q, attn, ring_positions(slots, start + MAX_ROWS) if sliding else None


def int4_linear(n: int, k: int, seed: int) -> SmallMLinear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(k // BLOCK_K, n, generator=g) * 0.02).to(torch.bfloat16)
    offset = (-8 * scale.float()).to(torch.bfloat16)
    return SmallMLinear(pack_codes(codes).cuda(), scale.cuda(), offset.cuda(), n, k)


def dense_linear(n: int, k: int, seed: int) -> SmallMLinear:
    g = torch.Generator().manual_seed(seed)
    return SmallMLinear.from_dense((torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16).cuda())


@pytest.mark.parametrize("kind,n,k", [("int4", 3072, 2560), ("int4", 2560, 10240), ("int4", 256, 2560),
                                      ("dense", 4096, 256), ("dense", 8192, 2560)])
def test_small_m_rows_are_batch_invariant(kind, n, k):
    """Split-K and not, int4 and dense: every row count gives each row the bits it has alone."""
    lin = (int4_linear if kind == "int4" else dense_linear)(n, k, seed=n + k)
    x = torch.randn(MAX_ROWS, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(MAX_ROWS)])
    for m in ROW_COUNTS:
        got = lin(x[:m])
        assert torch.equal(got, alone[:m]), f"{kind} N={n} K={k}: {m} rows differ from one row at a time"
    want = x.float() @ lin.dequantize().float().t()
    rel = (alone.float() - want).norm() / want.norm()
    assert rel < 1e-2, rel  # bf16 output rounding (~4e-3); a wrong tile gives ~1
    with pytest.raises(ValueError):
        lin(torch.zeros(MAX_ROWS + 1, k, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.parametrize("n,k", [(3072, 2560), (6144, 2560), (2560, 2048), (2560, 4096), (20480, 2560),
                                 (2560, 10240), (256, 2560), (2560, 256), (10752, 2560)])
def test_gluon_int4_kernel_gives_the_triton_kernels_bits(n, k):
    """server/gluon_matmul.py against `_small_m_kernel`, E4B's int4 shapes, every row count: the
    same bits, so drafted output equals plain output whichever of the two a GPU runs."""
    lin = int4_linear(n, k, seed=n + k)
    if not lin.gluon:
        pytest.skip("Gluon does not run here")
    x = torch.randn(MAX_ROWS, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    for m in ROW_COUNTS:
        lin.gluon = True
        ours = lin(x[:m])
        lin.gluon = False
        assert torch.equal(ours, lin(x[:m])), f"N={n} K={k}: {m} rows"


@pytest.mark.parametrize("n,k", [(3072, 2560), (20480, 2560), (2560, 10240), (256, 2560)])
def test_gluon_tilings_and_rings_give_the_same_bits(n, k, monkeypatch):
    """server/gluon_matmul.py's other tilings (128-column tiles, 32 columns a warp) and deeper rings,
    with the same K slices: a column's sums do not depend on its tile, its warp or on how far ahead
    the copies run, so every row count gives the shipped configuration's bits."""
    from server import gluon_matmul, small_m_matmul

    # every launch on the tiling it was built with (the wide switch would put 17+ rows on one tiling)
    monkeypatch.setattr(small_m_matmul, "WIDE_FROM_ROWS", None)

    lin = int4_linear(n, k, seed=n + k)
    if not lin.gluon:
        pytest.skip("Gluon does not run here")
    x = torch.randn(MAX_ROWS, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    for (block_n, warps), stages in [*((tiling, 2) for tiling in gluon_matmul.TILINGS[1:]),
                                     (gluon_matmul.TILINGS[0], 4), (gluon_matmul.TILINGS[1], 3)]:
        if n % block_n:
            continue
        other = SmallMLinear(lin.weight, lin.scale, lin.offset, n, k, block_n=block_n, num_warps=warps,
                             split=lin.split, gluon_stages=stages)
        assert other.gluon
        for m in ROW_COUNTS:
            assert torch.equal(other(x[:m]), lin(x[:m])), f"N={n} K={k} n{block_n} s{stages}: {m} rows"


@pytest.mark.parametrize("n,k", [(3072, 2560), (20480, 2560), (2560, 10240), (256, 2560)])
def test_gluon_x_through_l1_gives_the_same_bits(n, k, monkeypatch):
    """x copied in 8-byte pieces through L1 (server/gluon_matmul.py `X_VIA_L1_ROWS`) instead of 16-byte
    ones around it, on every tiling: the same shared-memory contents, so the same bits."""
    from server import gluon_matmul, small_m_matmul

    monkeypatch.setattr(small_m_matmul, "WIDE_FROM_ROWS", None)
    lin = int4_linear(n, k, seed=n + k)
    if not lin.gluon:
        pytest.skip("Gluon does not run here")
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    for block_n, warps in gluon_matmul.TILINGS:
        if n % block_n:
            continue
        other = SmallMLinear(lin.weight, lin.scale, lin.offset, n, k, block_n=block_n, num_warps=warps,
                             split=lin.split)
        for m in (1, 2, 3, 8, 15, 16):   # one row tile: the launches that copy x through L1
            monkeypatch.setattr(gluon_matmul, "X_VIA_L1_ROWS", 0)
            want = other(x[:m])
            monkeypatch.setattr(gluon_matmul, "X_VIA_L1_ROWS", MAX_ROWS)
            assert torch.equal(other(x[:m]), want), f"N={n} K={k} n{block_n} w{warps}: {m} rows"


@pytest.mark.parametrize("n,k", [(6144, 2560), (20480, 2560), (2560, 256)])
def test_gluon_paired_ring_gives_the_same_bits(n, k, monkeypatch):
    """The ring's two slots in allocations of their own (server/gluon_matmul.py `RING_PAIR`, on) against
    one allocation (the ring, which STAGES other than 2 still run), on the shipped tilings (the own
    and the wide), every row count, plain, gelu pairs, gelu times and split-K slices: the same copies
    and products in the same order, so the same bits. K groups a slice: 5 (6144 x 2560: odd, more than
    one pass), 20 (gate|up, one slice) and 1 (2560 x 256). Each new launch configuration (row tiles,
    kind, the setting, tiling, the rows' specializations) compiles a kernel of its own, so the shapes
    and tilings are the ones that tell the two loops apart, half as many of each as before: the other
    tilings, shapes and rings against the shipped kernel are the tests above."""
    from server import gluon_matmul, small_m_matmul

    monkeypatch.setattr(small_m_matmul, "WIDE_FROM_ROWS", None)
    lin = int4_linear(n, k, seed=n + k)
    if not lin.gluon:
        pytest.skip("Gluon does not run here")
    for block_n, warps in {gluon_matmul.TILINGS[0], small_m_matmul.WIDE_TILING}:
        if n % block_n:
            continue
        other = SmallMLinear(lin.weight, lin.scale, lin.offset, n, k, block_n=block_n, num_warps=warps,
                             split=lin.split)
        _assert_setting_keeps_bits(other, gluon_matmul, "RING_PAIR", monkeypatch, f"n{block_n} w{warps}")


def _assert_setting_keeps_bits(lin: SmallMLinear, module, setting: str, monkeypatch, label: str = "",
                               twice: bool = False) -> None:
    """`module.setting` True gives the bits False gives, for `lin` at every row count: plain, gelu
    pairs, split-K slices and gelu times; with `twice`, a second call on True too (the split-K
    counters were reset)."""
    n, k = lin.n, lin.k
    x = torch.randn(MAX_ROWS, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    u = torch.randn(MAX_ROWS, n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).cuda()
    kinds = [("plain", lin), ("pairs", lin.gelu_pairs()), ("slices", lin.slices),
             ("times", lambda rows: lin(rows, gelu_times=u[:rows.shape[0]]))]
    for m in ROW_COUNTS:
        for kind, run in kinds:
            monkeypatch.setattr(module, setting, False)
            want = run(x[:m]).clone()
            monkeypatch.setattr(module, setting, True)
            for call in range(1 + twice):
                assert torch.equal(run(x[:m]), want), f"N={n} K={k} {label} {kind}: {m} rows, call {call + 1}"


@pytest.mark.parametrize("n,k", [(6144, 2560), (20480, 2560), (2560, 256), (2560, 10240)])
def test_warp_specialized_kernel_gives_the_same_bits(n, k, monkeypatch):
    """server/gluon_ws_matmul.py (a producer warp's TMA and cp.async copies feeding the consumers'
    products) against server/gluon_matmul.py's kernel, on its tiling (64 columns, 4 warps), every row
    count, plain, gelu pairs, gelu times and split-K slices: the same products in the same order, so
    the same bits. K groups a slice: 5 (6144 x 2560: more than one pass of the ring of 4), 20
    (gate|up), 1 (2560 x 256) and 2560 x 10240's split; the split-K counters are reset (a second call
    after the first agrees too)."""
    from server import gluon_ws_matmul, small_m_matmul

    monkeypatch.setattr(small_m_matmul, "WIDE_FROM_ROWS", None)
    lin = int4_linear(n, k, seed=n + k)
    if not lin.gluon or not gluon_ws_matmul.runs_on(lin.weight.device):
        pytest.skip("the warp-specialized kernel does not run here (Hopper's TMA)")
    assert (lin.block_n, lin.num_warps) == gluon_ws_matmul.TILING
    _assert_setting_keeps_bits(lin, gluon_ws_matmul, "ON", monkeypatch, twice=True)


@pytest.mark.parametrize("tiling", [(64, 2), (128, 4)])
@pytest.mark.parametrize("n,k", [(20480, 2560), (2560, 10240)])
def test_wide_tiling_from_some_rows_gives_the_same_bits(n, k, tiling, monkeypatch):
    """server/small_m_matmul.py WIDE_FROM_ROWS: launches of that many rows or more switch to
    WIDE_TILING, on plain outputs, gelu pairs and split-K slices alike, and nothing changes."""
    from server import small_m_matmul

    lin = int4_linear(n, k, seed=n + k + 3)
    if not lin.gluon:
        pytest.skip("Gluon does not run here")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(MAX_ROWS, k, generator=gen).to(torch.bfloat16).cuda()
    pairs = lin.gelu_pairs() if n == 20480 else None
    monkeypatch.setattr(small_m_matmul, "WIDE_FROM_ROWS", None)   # the reference: the linear's own tiling
    ref = {m: (lin(x[:m]), lin.slices(x[:m]).clone(), pairs and pairs(x[:m])) for m in ROW_COUNTS}
    monkeypatch.setattr(small_m_matmul, "WIDE_FROM_ROWS", 1)
    monkeypatch.setattr(small_m_matmul, "WIDE_TILING", tiling)
    monkeypatch.setattr(small_m_matmul, "WIDE_MIN_COLUMNS", n + 1)   # too few columns: the own tiling
    assert lin._gluon_tiling(1) == (lin.block_n, lin.num_warps)
    monkeypatch.setattr(small_m_matmul, "WIDE_MIN_COLUMNS", n)
    assert lin._gluon_tiling(1) == tiling
    for m in ROW_COUNTS:
        y, parts, gelus = ref[m]
        assert torch.equal(lin(x[:m]), y), f"{tiling}: {m} rows"
        assert torch.equal(lin.slices(x[:m]), parts), f"{tiling}: {m} rows, slices"
        if pairs is not None:
            assert torch.equal(pairs(x[:m]), gelus), f"{tiling}: {m} rows, gelu pairs"


@pytest.mark.parametrize("n,k,target", [(20480, 2560, None), (20480, 2560, 528), (256, 2560, None), (512, 256, None)])
def test_gelu_epilogues_give_the_compiled_gelus_bits(n, k, target, monkeypatch):
    """GELU_PAIRS and GELU_TIMES (server/small_m_matmul.py) against the unfused step: the matmul's
    output, then the fast path's compiled gelu_mul kernel. The same bits at every row count, on the
    Gluon kernel and on `_small_m_kernel`, so fusing changes no step's output. E4B's gate|up in one
    K slice (as planned by default) and in two (TARGET_PROGRAMS 528: the epilogue then runs in the
    program that sums the slices), where a row's gelus are also the same at every row count."""
    from server import small_m_matmul
    from server.fast_ops import _compiled_ops

    gelu_mul = _compiled_ops().gelu_mul
    if target is not None:
        monkeypatch.setattr(small_m_matmul, "TARGET_PROGRAMS", target)
    lin = int4_linear(n, k, seed=n + k + 5)
    assert target is None or lin.split == 2
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(MAX_ROWS, k, generator=gen).to(torch.bfloat16).cuda()
    u = torch.randn(MAX_ROWS, 3, n, generator=gen).to(torch.bfloat16).cuda()[:, 1]  # strided, as ple[:, layer]
    pairs = lin.gelu_pairs()
    for gluon in {False, lin.gluon}:
        lin.gluon = pairs.gluon = gluon
        for m in ROW_COUNTS:
            y = lin(x[:m])
            gate, up = y.split(n // 2, -1)
            assert torch.equal(pairs(x[:m]), gelu_mul(gate, up)), f"pairs N={n} K={k} gluon={gluon}: {m} rows"
            assert torch.equal(lin(x[:m], gelu_times=u[:m]), gelu_mul(y, u[:m])), f"times N={n} gluon={gluon}: {m}"
            assert torch.equal(pairs(x[:m])[:1], pairs(x[:1])), f"pairs N={n} gluon={gluon}: row 0 at {m} rows"


def test_shared_scratch_changes_nothing():
    """share_partials points split-K linears at one buffer: same outputs, back to back."""
    from server.small_m_matmul import share_partials

    a, b = int4_linear(3072, 2560, 1), int4_linear(2560, 10240, 2)
    x1 = torch.randn(40, 2560, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    x2 = torch.randn(40, 10240, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    want = (a(x1), b(x2))
    assert a.split > 1 and b.split > 1
    share_partials([a, b])
    assert a.partial.data_ptr() == b.partial.data_ptr()
    for _ in range(3):
        assert torch.equal(a(x1), want[0]) and torch.equal(b(x2), want[1])


@pytest.mark.parametrize("sliding,start", [(False, 300), (True, 300), (False, 100), (True, 100), (True, 1000)])
def test_step_attention_rows_are_batch_invariant(sliding, start):
    """T queries at consecutive positions over a cache: each query's output equals the same query
    alone (T = 1), for T up to 64, across chunk boundaries (start 100: the step's keys span two
    chunks of 128) and the sliding window (start 1000: the ring of 1024 slots wraps)."""
    group, d, slots, window = 4, 256, 1024, 96
    k, v, q, attn, slot_pos = attention_case(5, slots, d, start, sliding)
    qpos = torch.arange(start, start + MAX_ROWS, device="cuda")
    alone = torch.cat([attn(q[i:i + 1], k, v, slots, qpos[i:i + 1], slot_pos, window, d ** -0.5)
                       for i in range(MAX_ROWS)])
    for t in ROW_COUNTS:
        got = attn(q[:t], k, v, slots, qpos[:t], slot_pos, window, d ** -0.5)
        assert torch.equal(got, alone[:t]), f"{t} queries differ from one at a time"
    # reference: fp32 softmax attention over the visible keys
    kf, vf = k.float().repeat_interleave(group, 0), v.float().repeat_interleave(group, 0)
    kpos = slot_pos if sliding else torch.arange(slots, device="cuda")
    vis = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= 0)
    if sliding:
        vis &= kpos[None, :] > qpos[:, None] - window
    scores = torch.einsum("thd,hsd->ths", q.float(), kf) * d ** -0.5
    p = torch.softmax(scores.masked_fill(~vis[:, None, :], float("-inf")), -1)
    want = torch.einsum("ths,hsd->thd", p, vf).reshape(MAX_ROWS, -1)
    rel = (alone.float() - want).norm() / want.norm()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("sliding,start,slots", [(False, 100, 1024), (False, 300, 1024), (True, 100, 1024),
                                                 (True, 1000, 1024), (True, 150, 200)])
def test_step_attention_tree_rows_equal_their_chains(sliding, start, slots):
    """A token tree of 64 rows (row j's K/V at slot start + j, row t at position start + depth(t)):
    each row's output equals, bit for bit, the last row of a chain step of its root path (the
    path's keys at consecutive slots), on chunk boundaries, a wrapping ring and a ring whose last
    chunk is partial (200 slots, chunks of 128)."""
    import random

    from server.fast_path import tree_paths, tree_rows

    d, window = 256, 96
    k, v, q, attn, slot_pos = attention_case(7, slots, d, start, sliding)
    rng = random.Random(start + slots)
    for reach in (None, 2):
        T = MAX_ROWS
        parents = [-1] + [rng.randrange(0 if reach is None else max(0, j - reach), j) for j in range(1, T)]
        depth, _ = tree_rows(parents, T, T)
        path = torch.from_numpy(tree_paths(parents, T, T)).cuda()
        qpos = torch.from_numpy(depth).cuda() + start
        tree = attn(q, k, v, slots, qpos, slot_pos, window, d ** -0.5, path)
        for t in range(T):
            rows = path[t, :depth[t] + 1]
            slot = lambda p: p % slots if sliding else p
            kc, vc = k.clone(), v.clone()
            at = torch.tensor([slot(start + i) for i in range(len(rows))], device="cuda")
            src = torch.tensor([slot(start + int(r)) for r in rows], device="cuda")
            kc[:, at], vc[:, at] = k[:, src], v[:, src]
            chain = attn(q[rows], kc, vc, slots, torch.arange(start, start + len(rows), device="cuda"),
                         slot_pos, window, d ** -0.5)
            assert torch.equal(tree[t], chain[-1]), f"reach {reach}: row {t} (depth {depth[t]}) differs from its chain"


@pytest.mark.parametrize("sliding,start,slots,d", [(False, 100, 1024, 512), (True, 100, 1024, 256),
                                                   (True, 1000, 1024, 256), (True, 150, 200, 256)])
@pytest.mark.parametrize("tree", [False, True])
def test_step_attention_writing_its_rows_changes_no_bit(sliding, start, slots, d, tree):
    """The step's K/V rows handed to the launch (`new_kv`), the cache's slots for them holding other
    numbers: the output is the one over a cache written beforehand, bit for bit, at every row count,
    chains and trees, and the cache ends as index_copy_ leaves it (row j at slot start + j)."""
    import random

    from server.fast_path import tree_paths, tree_rows

    window = 96
    k, v, q, attn, slot_pos = attention_case(11, slots, d, start, sliding)
    rng = random.Random(start)
    for T in ROW_COUNTS:
        if tree:
            parents = [-1] + [rng.randrange(max(0, j - 3), j) for j in range(1, T)]
            depth, _ = tree_rows(parents, T, T)
            path = torch.zeros(MAX_ROWS, MAX_ROWS, dtype=torch.int64)
            path[:T, :T] = torch.from_numpy(tree_paths(parents, T, T))
            path, qpos = path.cuda(), torch.from_numpy(depth).cuda() + start
        else:
            path, qpos = None, torch.arange(start, start + T, device="cuda")
        kv_len = slots if sliding else start + T
        want = attn(q[:T], k, v, kv_len, qpos, slot_pos, window, d ** -0.5, path)
        where = torch.arange(start, start + T, device="cuda") % (slots if sliding else 1 << 30)
        new_k, new_v = k[:, where].transpose(0, 1).contiguous(), v[:, where].transpose(0, 1).contiguous()
        stale_k, stale_v = k.clone(), v.clone()
        stale_k[:, where] += 100.0
        stale_v[:, where] -= 100.0
        got = attn(q[:T], stale_k, stale_v, kv_len, qpos, slot_pos, window, d ** -0.5, path, new_kv=(new_k, new_v))
        assert torch.equal(got, want), f"{T} rows (tree: {tree}) differ with the rows written by the launch"
        assert torch.equal(stale_k, k) and torch.equal(stale_v, v), f"{T} rows: the cache is not index_copy_'s"


@pytest.mark.parametrize("n,k", [(3072, 2560), (2560, 10240), (96, 384)])
def test_prefill_dequantization_kernel_equals_the_layout(n, k):
    """Prefill's Triton dequantization (W^T into a shared scratch) gives the layout's weights bit for
    bit, whatever the scratch held before and however much larger it is."""
    lin = int4_linear(n, k, seed=n + 2 * k)
    want = lin.dequantize().t()
    scratch = torch.full((n * k + 4096,), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert torch.equal(lin.dequantize_t(scratch), want)
    assert torch.equal(lin.dequantize_t(), want)
