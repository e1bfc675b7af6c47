"""server/gluon_matmul.py's int4 step matmul, checked in the sm_90 PTX it compiles to, here on the
CPU (CI has no GPU; tests/test_step_kernel_rows.py checks its output bits on one).

Its claim is that it computes `_small_m_kernel`'s products with the same instructions, decodes the
weights with fewer (a byte permute and a LOP3 a pair of weights), and moves the operands with fewer
instructions: each group's x rows arrive in one copy of 16-byte pieces where Triton's pipeliner
copies each 16-feature slice in 4-byte pieces.
"""
from __future__ import annotations

import re
from collections import Counter

import pytest

from tests.test_pdl_ptx import MATMUL_SIG
from tests.test_stacked_step_ptx import sm90_ptx

pytest.importorskip("triton")


def _ptx(tiles: int, split: int, epilogue: int = 0, x_l1: bool = False, paired: bool = False,
         prefetch: bool = False, pdl: bool = False) -> tuple[str, str]:
    from server import gluon_matmul
    from server.gpu_kernels import _small_m_kernel

    if not gluon_matmul.HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    ours = dict(SPLIT=split, TILES=tiles, ROWS=16 * tiles, XROWS=gluon_matmul.x_rows(tiles), BLOCK_N=64, STAGES=2,
                EPILOGUE=epilogue, PREFETCH=prefetch, X_L1=x_l1, PAIRED=paired, PDL=pdl)
    theirs = dict(INT4=True, SPLIT=split, MAGIC=True, TILES=tiles, ROWS=16 * tiles, BLOCK_M=16, BLOCK_N=64,
                  BLOCK_K=128, EPILOGUE=epilogue)
    sig = lambda consts: dict(MATMUL_SIG, **{key: "constexpr" for key in consts})
    return (sm90_ptx(gluon_matmul.int4_step_matmul, sig(ours), ours),
            sm90_ptx(_small_m_kernel, sig(theirs), theirs))


def _arithmetic(ptx: str) -> Counter:
    """The products and the bf16 decoding arithmetic, by instruction."""
    return Counter(re.findall(r"mma\.sync[.\w]*|fma\.rn\.bf16x2|add\.bf16x2|sub\.bf16x2|mul\.rn\.bf16x2", ptx))


@pytest.mark.parametrize("tiles", [1, 2, 4])
def test_products_and_decoding_are_the_triton_kernels_instructions(tiles):
    ours, theirs = _ptx(tiles, split=1)
    assert _arithmetic(ours) == _arithmetic(theirs)
    assert _arithmetic(ours)["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"] > 0


@pytest.mark.parametrize("tiles", [1, 4])
def test_a_pair_of_weights_decodes_in_two_integer_instructions(tiles):
    """Each bf16x2 operand register (two weights) comes from one byte permute and one LOP3: as many
    of each as there are bf16x2 FMAs (the scale and offset), and none of the per-element path's 16-bit
    shifts and conversions, which the Triton kernel's decoding is made of."""
    ours, theirs = _ptx(tiles, split=1)
    pairs = len(re.findall(r"fma\.rn\.bf16x2", ours))
    assert pairs > 0
    assert len(re.findall(r"prmt\.b32 t, ", ours)) == pairs
    assert _decodings(ours) == pairs
    per_element = r"\b(?:shr\.u16|cvt\.u16\.u32)\b"
    assert not re.search(per_element, ours) and re.search(per_element, theirs)


def _decodings(ptx: str) -> int:
    """The LOP3s that finish decoding a pair of weights (`_slice_codes`)."""
    return len(re.findall(r"lop3\.b32 [^;]*0x000F000F, 0x43004300", ptx))


def _before(ptx: str, marker: str) -> str:
    """The kernel's body up to the first `marker`."""
    body = ptx[ptx.index(".entry"):]
    return body[:body.index(marker)]


def _copies(ptx: str) -> Counter:
    """Asynchronous copies by width in bytes."""
    return Counter(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", ptx))


def _copies_by_cache(ptx: str) -> Counter:
    """Asynchronous copies by (cache operator, width in bytes)."""
    return Counter(re.findall(r"cp\.async\.(c[ag])\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", ptx))


@pytest.mark.parametrize("tiles", [1, 2])
def test_x_through_l1_changes_only_xs_copies(tiles):
    """X_L1 (server/gluon_matmul.py `X_VIA_L1_ROWS`): x's copies go through L1 (.ca, 8-byte pieces,
    twice as many as the 16-byte .cg ones they replace); the weights' copies and the arithmetic are
    unchanged."""
    around, _ = _ptx(tiles, split=1)
    through, _ = _ptx(tiles, split=1, x_l1=True)
    before, after = _copies_by_cache(around), _copies_by_cache(through)
    x_wide = before[("cg", "0x10")] - after[("cg", "0x10")]
    assert x_wide > 0 and after[("ca", "0x8")] == 2 * x_wide and before[("ca", "0x8")] == 0
    assert after[("ca", "0x4")] == before[("ca", "0x4")]   # scales and offsets
    assert _arithmetic(through) == _arithmetic(around)


@pytest.mark.parametrize("tiles", [1, 3])
def test_operands_arrive_by_fewer_wider_copies(tiles):
    """Without split-K the kernel reads global memory only through cp.async; only the scales and
    offsets (64 bf16 each) are copied in 4-byte pieces, and it issues fewer copies than the Triton
    kernel."""
    ours, theirs = _ptx(tiles, split=1)
    assert not re.search(r"\bld\.global", ours)
    assert _copies(ours)["0x4"] <= 4 and _copies(ours)["0x10"] > 0
    assert sum(_copies(ours).values()) < sum(_copies(theirs).values())


def test_split_k_reads_back_only_partials():
    """With split-K the only global loads are the partial sums', read through L2 (.cg)."""
    ours, _ = _ptx(2, split=4)
    loads = re.findall(r"\bld\.global[.\w]*", ours)
    assert loads and all(".cg" in load for load in loads)


@pytest.mark.parametrize("split", [1, 4])
def test_gelu_pairs_split_off_in_registers(split):
    """GELU_PAIRS (server/small_m_matmul.py): a thread holds each gate column and its up column, so
    the epilogue adds the activation's arithmetic (libdevice's tanh, as torch.compile's kernels call)
    and nothing else: no shared-memory round trip, no barrier, and the operands' copies as wide as
    without it (a tile's two halves are contiguous runs of columns)."""
    plain, _ = _ptx(2, split)
    pairs, theirs = _ptx(2, split, epilogue=1)
    shared = lambda ptx: len(re.findall(r"\b(?:st|ld)\.shared", ptx))
    barriers = lambda ptx: len(re.findall(r"\bbar\.sync", ptx))
    assert "__nv_tanhf" in pairs and "__nv_tanhf" in theirs and "__nv_tanhf" not in plain
    assert shared(pairs) == shared(plain) and barriers(pairs) == barriers(plain)
    assert _copies(pairs) == _copies(plain)
    if split > 1:   # the partials' fp32 stores are the same in both
        return
    # half the output columns: half the bytes stored
    stored = lambda ptx: sum(int(v or 1) * int(bits) // 8
                             for v, bits in re.findall(r"st\.global(?:\.v(\d))?\.b(\d+)", ptx))
    assert stored(plain) > 0 and 2 * stored(pairs) == stored(plain)


# server/gluon_matmul.py RING_PAIR (on by default since stop 70): the ring's two slots as
# allocations of their own, the loop taking two groups a pass.

@pytest.mark.parametrize("tiles,split", [(1, 1), (2, 4), (4, 1)])
def test_paired_ring_has_one_barrier_a_group(tiles, split):
    """Two groups a pass, each with the ring kernel's products, decoding and copies, and one barrier a
    group where the one-allocation ring has two (the compiler's own between the copies into one slot
    and the reads of the other)."""
    paired, _ = _ptx(tiles, split, paired=True)
    ring, _ = _ptx(tiles, split)
    twice = lambda counts: Counter({op: 2 * n for op, n in counts.items()})
    assert _arithmetic(paired) == twice(_arithmetic(ring))
    assert _decodings(paired) == 2 * _decodings(ring)
    # the loop's copies twice (two groups a pass); the first group's, before the loop's first barrier,
    # once in both
    copies = lambda ptx: sum(_copies(ptx).values())
    assert copies(paired) - copies(ring) == copies(ring) - copies(_before(ring, "bar.sync"))
    barriers = lambda ptx: len(re.findall(r"\bbar\.sync", ptx))
    assert barriers(paired) == barriers(ring)


def test_paired_ring_copies_only_weights_before_the_wait():
    """PREFETCH with RING_PAIR, as the ring: the first group's words, scales and offsets are copied before
    waiting for the kernel before this one; x and everything else only after."""
    paired, _ = _ptx(2, 4, paired=True, prefetch=True, pdl=True)
    ring, _ = _ptx(2, 4, prefetch=True, pdl=True)
    early = lambda ptx: Counter(re.findall(r"\b(?:ld|st|atom|red)\.global[.\w]*|cp\.async\.c[ag][.\w]*",
                                           _before(ptx, "griddepcontrol.wait")))
    assert early(paired) == early(ring) and sum(early(ring).values()) > 0


def _barrier_before_counter(ptx: str) -> bool:
    """Whether the warps meet (bar.sync) between the last partial store and the split-K counter's atomic."""
    body = ptx[ptx.index(".entry"):]
    before = body[:body.index("atom.")]
    return "bar.sync" in before[before.rfind("st.global"):]


@pytest.mark.parametrize("tiles", [1, 4])
def test_split_k_counter_moves_after_every_warps_partials(tiles):
    """The acq_rel atomic on a column tile's counter is one thread's: it publishes what that thread
    wrote or saw, so every warp's partial stores come before a barrier before it (as in the Triton
    kernel's PTX); otherwise the last slice could sum a partial another warp had not yet made visible."""
    ours, theirs = _ptx(tiles, split=4, paired=True, prefetch=True, pdl=True)
    assert _barrier_before_counter(theirs)
    assert _barrier_before_counter(ours)
