"""The stacked steps' kernels load and store as wide as the lone step's, checked in the PTX that
Triton compiles for Hopper (sm_90), here on the CPU.

Why: a stacked segment finds its caches through a table of addresses (server/batch_step.py). An
address loaded from memory carries no alignment the compiler can see (a kernel argument's does:
Triton specializes it), so without `tl.multiple_of` hints every K/V load is one bf16 wide: 1024
scalar loads where the lone kernel issues 128-bit ones, which made a stacked forward of 2 lanes
cost 2.2x a lone step on the H200 (bench.gpu_concurrency, before the hints). CI has no GPU; the PTX
shows the instruction widths all the same.
"""
from __future__ import annotations

import functools
import re
from collections import Counter

import pytest

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _noop(x_ptr):
    """The smallest kernel: whether anything compiles for sm_90 here."""
    tl.store(x_ptr, 0.0)


INTS = ("T", "S", "n_cache_chunks", "n_own_chunks", "window", "kv_heads", "k_field", "v_field", "stride_count")


@functools.cache
def _sm90_compiler_missing() -> str | None:
    """Why this Triton cannot compile for sm_90 at all (no NVIDIA backend or ptxas), or None."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        triton.compile(ASTSource(_noop, {"x_ptr": "*fp32"}), target=GPUTarget("cuda", 90, 32))
    except Exception as e:
        return str(e)
    return None


def sm90_ptx(fn, sig: dict, constexprs: dict, **options) -> str:
    """fn's PTX for sm_90 (a Triton or a Gluon kernel), compiled with `options` (num_warps, maxnreg, ...);
    pointers and strides specialized as Triton does for 16-divisible arguments. Skips only where no
    kernel compiles for sm_90 here: an error in fn's own compilation fails the test."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = _sm90_compiler_missing()
    if missing is not None:  # a Triton without its NVIDIA backend's compiler
        pytest.skip(f"Triton cannot compile for sm_90 here: {missing}")

    # A constexpr left out of a compile from source is not its default value (it would compile another
    # variant than the one a launch runs): the defaults are filled in.
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in constexprs}
    constexprs = dict(constexprs, **defaults)
    sig = dict(sig, **{name: "constexpr" for name in defaults})
    if getattr(fn, "is_gluon", lambda: False)():  # server/gluon_matmul.py: Gluon's own source class
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    names = list(sig)
    aligned = [n for n, t in sig.items() if t.startswith("*") or (t == "i32" and n not in INTS)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=options or None)
    return compiled.asm["ptx"]


def _ptx_accesses(fn, sig: dict, constexprs: dict) -> Counter:
    """Global load/store instructions by width in fn's sm_90 PTX."""
    return Counter(re.findall(r"(?:ld|st)\.global[.\w]*", sm90_ptx(fn, sig, constexprs)))


def _lone_signature(consts: dict) -> dict:
    sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr")}
    sig.update({n: "*i64" for n in ("slot_pos_ptr", "qpos_ptr", "path_ptr")})
    sig.update({n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr")})
    sig.update({n: "i32" for n in ("T", "S", "n_cache_chunks", "n_own_chunks", "window")})
    sig["scaling"] = "fp32"
    sig.update({n: "i32" for n in ("stride_qt", "stride_qh", "stride_kh", "stride_ks", "stride_pt", "n_rows",
                                   "n_chunks")})
    sig.update(_NEW_ROWS)
    sig.update({n: "constexpr" for n in consts})
    return sig


# the step's new K/V rows (server/step_attention.py new_kv): pointers and their row / head strides
_NEW_ROWS = {"nk_ptr": "*bf16", "nv_ptr": "*bf16", "stride_nkt": "i32", "stride_nkh": "i32", "stride_nvt": "i32",
             "stride_nvh": "i32"}


def _segments_signature(consts: dict) -> dict:
    sig = {"q_ptr": "*bf16", "table_ptr": "*i64", "k_field": "i32", "v_field": "i32", "qpos_ptr": "*i64"}
    sig.update({n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr")})
    sig.update({n: "i32" for n in ("kv_heads", "T", "S", "n_cache_chunks", "n_own_chunks", "window")})
    sig["scaling"] = "fp32"
    sig.update({n: "i32" for n in ("stride_qt", "stride_qh", "stride_kh", "stride_ks", "stride_pt", "stride_table",
                                   "n_rows", "n_chunks")})
    sig.update(_NEW_ROWS)
    sig.update({n: "constexpr" for n in consts})
    return sig


@pytest.mark.parametrize("sliding,head_dim", [(False, 512), (True, 256)])
def test_stacked_attention_loads_keys_as_wide_as_the_lone_kernel(sliding, head_dim):
    from server import gpu_kernels as kernels
    from server.step_attention import BLOCK_R, _block_s

    consts = dict(G=4, D=head_dim, SLIDING=sliding, BLOCK_R=BLOCK_R, BLOCK_S=_block_s(head_dim))
    lone = _ptx_accesses(kernels._step_attention_partials, _lone_signature(consts), consts)
    seg_consts = dict(consts, SLOT_POS_FIELD=30, PATH_FIELD=31)
    stacked = _ptx_accesses(kernels._step_attention_partials_segments, _segments_signature(seg_consts), seg_consts)
    wide = [k for k in lone if ".v4" in k]
    assert wide, lone  # the lone kernel's 128-bit K/V loads (the reference this checks against)
    assert {k: stacked[k] for k in wide} == {k: lone[k] for k in wide}, (stacked, lone)
    assert "ld.global.b16" not in stacked and "ld.global.u16" not in stacked, stacked


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("sliding,head_dim", [(False, 512), (True, 256)])
def test_writing_new_kv_rows_adds_only_row_stores_and_loads(stacked, sliding, head_dim):
    """With the step's K/V rows handed to it (WRITE), the attention launch's K/V loads are as wide as
    without (136 / 144 128-bit loads: one address a column, then one load a tile), and what it adds
    is the rows' copy: loads and stores of at least two elements a thread (a row of D contiguous
    elements over the program's threads), none one element at a time."""
    from server import gpu_kernels as kernels
    from server.step_attention import BLOCK_R, _block_s

    consts = dict(G=4, D=head_dim, SLIDING=sliding, BLOCK_R=BLOCK_R, BLOCK_S=_block_s(head_dim))
    if stacked:
        consts.update(SLOT_POS_FIELD=30, PATH_FIELD=31)
        fn, signature = kernels._step_attention_partials_segments, _segments_signature
    else:
        fn, signature = kernels._step_attention_partials, _lone_signature
    plain = _ptx_accesses(fn, signature(consts), consts)
    writing = _ptx_accesses(fn, signature(dict(consts, WRITE=True)), dict(consts, WRITE=True))
    wide = [k for k in plain if ".v4" in k]
    assert wide and {k: writing[k] for k in wide} == {k: plain[k] for k in wide}, (writing, plain)
    added = writing - plain
    assert any(k.startswith("st.") for k in added) and any(k.startswith("ld.") for k in added), added
    assert not any(k.endswith(("b16", "u16")) for k in added), added
