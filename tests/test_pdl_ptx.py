"""Programmatic dependent launch in the step kernels (server/gpu_kernels.py `_pdl_start`), checked
in the sm_90 PTX that Triton compiles, here on the CPU.

Why: a kernel launched with launch_pdl may start while the kernel before it still runs. It is
correct only if it waits (griddepcontrol.wait) before it touches memory another kernel writes: a
load before the wait could read what the previous kernel has not written yet. The step kernels wait
before any memory access, but for the Gluon matmul's read-only weights (server/gluon_matmul.py
PREFETCH: the last test). Without PDL (older GPUs, the interpreter) no griddepcontrol instruction is
emitted.
"""
from __future__ import annotations

import re

import pytest

from tests.test_stacked_step_ptx import _lone_signature, _segments_signature, sm90_ptx

pytest.importorskip("triton")

MATMUL_SIG = {"x_ptr": "*bf16", "w_ptr": "*i32", "scale_ptr": "*bf16", "offset_ptr": "*bf16", "partial_ptr": "*fp32",
              "count_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
              "k_per_split": "i32", "u_ptr": "*bf16", "stride_u": "i32"}


def _kernels():
    from server import gpu_kernels as k
    from server.step_attention import BLOCK_R, _block_s

    att = dict(G=4, D=256, SLIDING=True, BLOCK_R=BLOCK_R, BLOCK_S=_block_s(256))
    seg = dict(att, SLOT_POS_FIELD=30, PATH_FIELD=31)
    combine_sig = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "qpos_ptr": "*i64", "out_ptr": "*bf16",
                   "stride_ot": "i32", "n_rows": "i32", "n_chunks": "i32", "n_used": "i32"}
    slot_sig = {"table_ptr": "*i64", "wpos_ptr": "*i64", "ring_slot_ptr": "*i64", "T": "i32", "stride_table": "i32"}
    return [
        ("small_m", k._small_m_kernel, dict(MATMUL_SIG), dict(INT4=True, SPLIT=4, MAGIC=True, TILES=2, ROWS=32,
                                                            BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, EPILOGUE=0)),
        ("attention", k._step_attention_partials, _lone_signature(att), att),
        ("attention writing K/V", k._step_attention_partials, _lone_signature(att), dict(att, WRITE=True)),
        ("attention segments", k._step_attention_partials_segments, _segments_signature(seg), seg),
        ("attention segments writing K/V", k._step_attention_partials_segments, _segments_signature(seg),
         dict(seg, WRITE=True)),
        ("combine", k._step_attention_combine, combine_sig, dict(G=4, D=256, SLIDING=True, BLOCK_S=_block_s(256))),
        ("slot positions", k._write_slot_pos_segments, slot_sig, dict(SLOT_POS_FIELD=30)),
        ("gluon int4 matmul", _gluon_matmul(), dict(MATMUL_SIG),
         dict(SPLIT=4, TILES=2, ROWS=32, XROWS=32, BLOCK_N=64, STAGES=2, EPILOGUE=0, PREFETCH=False)),
        ("residual norm", k._summed_residual_norm, dict(RESIDUAL_NORM_SIG),
         dict(SLICES=8, HAS_W=True, HAS_SCALAR=True, NEXT=True, HAS_W_NEXT=True, BLOCK=4096)),
        ("q/k/v norms", k._summed_qkv_norm_rope, dict(QKV_NORM_SIG),
         dict(D=256, SLICES=8, HAS_WQ=True, HAS_WK=True, HAS_WV=False)),
    ]


# server/step_norms.py's kernels
RESIDUAL_NORM_SIG = {"p_ptr": "*fp32", "res_ptr": "*bf16", "w_ptr": "*bf16", "scalar_ptr": "*bf16",
                     "w_next_ptr": "*bf16", "h_ptr": "*bf16", "x_ptr": "*bf16", "N": "i32", "stride_ps": "i32",
                     "stride_pm": "i32", "stride_rm": "i32", "stride_hm": "i32", "stride_xm": "i32", "eps": "fp32",
                     "eps_next": "fp32"}
QKV_NORM_SIG = {**{name: "*fp32" for name in ("pq_ptr", "pk_ptr", "pv_ptr")},
                **{name: "*bf16" for name in ("wq_ptr", "wk_ptr", "wv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr",
                                              "v_ptr")},
                **{name: "i32" for name in ("stride_ps", "stride_pt", "stride_cos", "stride_sin")},
                "eps_q": "fp32", "eps_k": "fp32", "eps_v": "fp32", "H": "i32", "KVH": "i32"}


# (A constexpr left out of a compile from source is not its default: every one the kernel has is given.)


def _gluon_matmul():
    from server import gluon_matmul
    if not gluon_matmul.HAS_GLUON:
        pytest.skip("this Triton has no Gluon")
    return gluon_matmul.int4_step_matmul


# The kernels `_kernels` lists, by name (parameters are collected before Triton is imported);
# test_every_listed_kernel_is_checked keeps the two lists the same.
KERNEL_NAMES = ("small_m", "attention", "attention writing K/V", "attention segments",
                "attention segments writing K/V", "combine", "slot positions", "gluon int4 matmul",
                "residual norm", "q/k/v norms")


def test_every_listed_kernel_is_checked():
    assert tuple(name for name, *_ in _kernels()) == KERNEL_NAMES


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_a_pdl_kernel_waits_before_its_first_memory_access(name):
    fn, sig, consts = next(rest for kernel, *rest in _kernels() if kernel == name)
    for key in list(consts) + ["PDL"]:
        sig[key] = "constexpr"
    ptx = sm90_ptx(fn, dict(sig), dict(consts, PDL=True))
    body = ptx[ptx.index(".entry"):]
    wait = body.find("griddepcontrol.wait")
    access = re.search(r"\b(?:ld\.global|st\.global|atom\.global|red\.global|cp\.async\.c[ag]\.shared\.global)", body)
    assert wait >= 0 and access is not None and wait < access.start(), name
    assert "griddepcontrol.launch_dependents" in body, name
    assert "griddepcontrol" not in sm90_ptx(fn, dict(sig), dict(consts, PDL=False)), name


@pytest.mark.parametrize("split,epilogue", [(1, 0), (4, 0), (1, 1), (4, 1), (1, 2), (4, 2)])
def test_the_gluon_matmul_copies_only_weights_before_its_wait(split, epilogue):
    """server/gluon_matmul.py PREFETCH: the kernel starts (programmatic dependent launch) while the one
    before it runs, and copies its first group's weight words, scales and offsets, which no kernel
    writes, before waiting for it; x and u (earlier kernels' outputs), the partials and the counters
    are read or written only after the wait, with every epilogue."""
    fn = _gluon_matmul()
    consts = dict(SPLIT=split, TILES=2, ROWS=32, XROWS=32, BLOCK_N=64, STAGES=2, EPILOGUE=epilogue, PDL=True)
    sig = dict(MATMUL_SIG, **{key: "constexpr" for key in list(consts) + ["PREFETCH"]})
    body = lambda prefetch: (lambda ptx: ptx[ptx.index(".entry"):])(sm90_ptx(fn, sig, dict(consts, PREFETCH=prefetch)))
    early = body(True)[:body(True).index("griddepcontrol.wait")]
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", early)
    # one group's weights: [16, 64] words (two 16-byte copies a thread), 64 scales and 64 offsets (4 bytes)
    assert sorted(copies) == ["0x10", "0x10", "0x4", "0x4"], copies
    assert not re.search(r"\b(?:ld|st|atom|red)\.global", early)
    late = body(False)
    late = late[:late.index("griddepcontrol.wait")]
    assert "cp.async" not in late and not re.search(r"\b(?:ld|st|atom|red)\.global", late)
