"""server/gluon_ws_matmul.py's warp-specialized int4 step matmul, checked in the sm_90 PTX it
compiles to, here on the CPU (CI has no GPU; tests/test_step_kernel_rows.py checks its bits on one).

Its claims: the consumer warps compute server/gluon_matmul.py's products with its decoding
instructions; the weights, scales and offsets arrive by TMA (six boxes a group) and x's rows by
cp.async that arrive on the same mbarrier; before waiting for the kernel before it, it copies only
weights (TMA), never x; and it compiles within `MAXNREG` registers a thread with no spills.
"""
from __future__ import annotations

import re
from collections import Counter

import pytest

from tests.test_gluon_matmul_ptx import _arithmetic, _decodings
from tests.test_pdl_ptx import MATMUL_SIG
from tests.test_stacked_step_ptx import sm90_ptx

pytest.importorskip("triton")


def _ws_ptx(tiles: int, split: int, epilogue: int = 0, pdl: bool = True) -> str:
    import torch

    from server import gluon_matmul, gluon_ws_matmul

    if not gluon_ws_matmul.HAS_TMA:
        pytest.skip("this Triton has no Gluon TMA")
    from triton.runtime.jit import mangle_type

    n, k = 2048, 2560
    weight = torch.zeros(k // 8, n, dtype=torch.int32)
    scale = torch.zeros(k // 128, n, dtype=torch.bfloat16)
    descs = gluon_ws_matmul.descriptors(weight, scale, scale.clone(), pairs=epilogue == 1)
    sig = {name: t for name, t in MATMUL_SIG.items() if name not in ("w_ptr", "scale_ptr", "offset_ptr")}
    sig = dict(x_ptr=sig.pop("x_ptr"), **{name: mangle_type(d) for name, d in
                                           zip(("w_desc", "scale_desc", "offset_desc"), descs)}, **sig)
    consts = dict(SPLIT=split, TILES=tiles, ROWS=16 * tiles, XROWS=gluon_matmul.x_rows(tiles), BLOCK_N=64,
                  STAGES=gluon_ws_matmul.STAGES, PRODUCER_REGS=gluon_ws_matmul.registers(tiles)[1], PDL=pdl,
                  EPILOGUE=epilogue, X_L1=tiles == 1)
    return sm90_ptx(gluon_ws_matmul.int4_step_matmul_ws, dict(sig, **{key: "constexpr" for key in consts}), consts,
                    num_warps=gluon_ws_matmul.TILING[1], maxnreg=gluon_ws_matmul.registers(tiles)[0])


def _gluon_ptx(tiles: int, split: int, epilogue: int = 0) -> str:
    from server import gluon_matmul

    consts = dict(SPLIT=split, TILES=tiles, ROWS=16 * tiles, XROWS=gluon_matmul.x_rows(tiles), BLOCK_N=64, STAGES=2,
                  EPILOGUE=epilogue, PREFETCH=True, X_L1=tiles == 1, PAIRED=True, PDL=True)
    return sm90_ptx(gluon_matmul.int4_step_matmul, dict(MATMUL_SIG, **{key: "constexpr" for key in consts}), consts)


@pytest.mark.parametrize("tiles,epilogue", [(1, 0), (2, 1), (4, 2)])
def test_products_and_decoding_are_the_gluon_kernels(tiles, epilogue):
    """The same mma.sync and bf16x2 arithmetic as server/gluon_matmul.py's kernel (one K group's loop
    body each), and each pair of weights decoded by one byte permute and one LOP3."""
    ours, theirs = _ws_ptx(tiles, split=1, epilogue=epilogue), _gluon_ptx(tiles, split=1, epilogue=epilogue)
    # the paired ring's loop body holds two groups, this kernel's one
    assert Counter({op: 2 * n for op, n in _arithmetic(ours).items()}) == _arithmetic(theirs)
    assert _arithmetic(ours)["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"] > 0
    pairs = len(re.findall(r"fma\.rn\.bf16x2", ours))
    assert pairs > 0 and _decodings(ours) == pairs


@pytest.mark.parametrize("epilogue", [0, 1])
def test_weights_by_tma_x_by_cp_async_on_the_full_barrier(epilogue):
    """A group's weight words are two TMA boxes, its scales and its offsets one each; x's rows are the
    only cp.async copies, and their completion arrives on the slot's mbarrier (noinc: the barrier
    counts the producer warp's 32 threads)."""
    from server import gluon_ws_matmul

    ptx = _ws_ptx(1, split=1, epilogue=epilogue)
    boxes = re.findall(r"cp\.async\.bulk\.tensor\.(\dd)\.shared::cluster\.global", ptx)
    # STAGES groups' boxes before the loop (the prefetch) and one group's in it
    assert Counter(boxes) == Counter({"2d": 4 * (gluon_ws_matmul.STAGES + 1)})
    assert re.search(r"cp\.async\.mbarrier\.arrive\.noinc\.shared\.b64", ptx)
    assert re.search(r"mbarrier\.init\.shared::cta\.b64 \[[^]]+\], 33;", ptx)
    assert not re.search(r"\bld\.global", ptx)   # no split-K: every operand comes through the ring


@pytest.mark.parametrize("tiles,epilogue", [(1, 0), (1, 1), (4, 2)])
def test_tma_destinations_are_aligned(tiles, epilogue):
    """Every TMA box lands 128-byte aligned in shared memory (a misaligned box faults: the scales' and
    offsets' halves, once boxes of their own, sat 64 bytes in): the offsets the PTX adds to the
    shared memory's base, known for every box but those at the base itself."""
    ptx = _ws_ptx(tiles, split=1, epilogue=epilogue)
    offsets = {}
    for line in ptx.splitlines():
        m = re.match(r"\s*add\.s32\s+(%r\d+), %r\d+, (\d+);", line)
        if m:
            offsets[m.group(1)] = int(m.group(2))
    dests = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier::complete_tx::bytes "
                       r"\[(%r\d+)\]", ptx)
    known = [offsets[reg] for reg in dests if reg in offsets]
    assert dests and len(known) >= len(dests) - 2
    assert all(at % 128 == 0 for at in known), f"boxes at shared offsets {known}"


def test_only_weights_are_copied_before_the_wait():
    """With PDL the producer's first STAGES groups of weights (read-only) go before its
    griddepcontrol.wait; x, which the kernel before writes, only after."""
    ptx = _ws_ptx(1, split=1, pdl=True)
    body = ptx[ptx.index(".entry"):]
    waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", body)]
    assert len(waits) == 2   # the consumers' and the producer's
    tma_at = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor", body)]
    x_at = [m.start() for m in re.finditer(r"cp\.async\.c[ag]\.shared\.global", body)]
    producer_wait = max(w for w in waits if w < min(x_at))
    assert x_at and min(x_at) > producer_wait
    assert any(t < producer_wait for t in tma_at)


@pytest.mark.parametrize("tiles", [1, 2, 3, 4])
def test_fits_its_registers_without_spills(tiles):
    """The kernel's registers a thread stay within its launch's MAXNREG (at one and two row tiles
    three CTAs of 8 warps an SM), with no spills, at every row tile count (ptxas on the CPU)."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    from server import gluon_ws_matmul

    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    if not ptxas.exists():
        pytest.skip("no ptxas in this Triton")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(_ws_ptx(tiles, split=4, epilogue=1))
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    info = out.stderr + out.stdout
    assert out.returncode == 0, info
    assert int(re.search(r"Used (\d+) registers", info).group(1)) <= gluon_ws_matmul.registers(tiles)[0]
    assert re.search(r"\b0 bytes spill stores", info), info


@pytest.mark.parametrize("tiles", [1, 4])
def test_split_k_counter_moves_after_every_warps_partials(tiles):
    """As server/gluon_matmul.py's kernel: the consumer warps' partial stores, then a barrier, then
    the counter's acq_rel atomic (tests/test_gluon_matmul_ptx.py says why)."""
    from tests.test_gluon_matmul_ptx import _barrier_before_counter

    assert _barrier_before_counter(_ws_ptx(tiles, split=4))
