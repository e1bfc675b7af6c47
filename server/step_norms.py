"""The step's norms that read a split-K matmul's K slices, as Triton kernels: the residual norms,
and an attention layer's q / k / v norms with RoPE.

Contract: `summed_residual_norm(residual, p, w, eps, scalar)` and
`summed_residual_norm_rms(residual, p, w, eps, scalar, w_next, eps_next)` take what
server/fast_ops.py's `_summed_residual_norm` / `_summed_residual_norm_rms` take (residual [T, N],
p [S, T, N]: a linear's K-slice partials, server/small_m_matmul.py `slices`) and give what they
give: h = residual + RMSNorm(sum of the slices) * w [* scalar], and for the second also
x = RMSNorm(h) * w_next, in the residual's dtype. The slices are added in slice order and rounded
once (`sum_slices`), and every value is rounded where transformers' modules round it; the norms'
sums of squares are the kernel's own (one tree sum over the row), so the bits are not the compiled
ops' bits, and are the same for a row whatever the other rows are and however many: one program a
row, the same instructions for every row count (batch invariance, as server/small_m_matmul.py
explains).

`summed_qkv_norm_rope(pq, pk, pv, dtype, wq, eps_q, wk, eps_k, wv, eps_v, cos, sin)` and
`summed_norm_rope(pq, dtype, w, eps, cos, sin)` likewise take and give what fast_ops'
`_summed_qkv_norm_rope` / `_summed_norm_rope` do (partials [S, T, heads, D], each head's RMSNorm,
q and k rotated by cos / sin [T, 1, D]): one launch a layer, a program a (row, head), where the
compiled ops took three kernels for a layer that owns its K/V (q's, k's and v's). Each normed value
is rounded as the ops round it; the rotation x * cos + rotate_half(x) * sin is one rounding short
of theirs: the compiler contracts one product and the sum into a bf16 fma (fma.rn.bf16x2 in the
sm_90 PTX), as inductor's compiled op computes it in fp32. The same for every row, so a row's bits
still never depend on the others.

Why: the compiled ops are inductor's looped reductions (`triton_red_` kernels), which by their kind
recompute their inputs, the slices' sum, in each pass over the row (the sum of squares of y, then
of h, then the stores; inferred, the generated code was not read): on E4B, 126 such kernels a step
at about 3.8 us each, 0.49 ms of a 3.5 ms one-token step on an H100. This kernel holds the row in
registers and reads the slices once. `RESIDUAL_NORM_KERNEL` and `QKV_NORM_KERNEL`
in server/fast_path.py switch them (A/B runs: `python -m bench.step_ab`).
"""
from __future__ import annotations

import torch

# Warps of a residual norm's program (None: a warp per 256 of the row's padded width, 4 to 16: 16 for
# E4B's 2560). The row's sums of squares are tree sums across the program's warps, so a count is part
# of the kernel's bits (the same for every row count, so steps stay batch-invariant). 4 against 16
# (one run of `python -m bench.step_ab --base-tree . --head-set server.step_norms.RESIDUAL_NORM_WARPS=4
# --rounds 1 --reps 100` on an H100, bench/results/step_ab-norm-warps-h100.md): the 126 norms of a
# one-token step 0.373 -> 0.375 ms, a step 3.13 -> 3.16: no gain. A launch's few microseconds are its
# wait and its round trips to memory, not its warps' work.
RESIDUAL_NORM_WARPS: int | None = None


def _launch(residual: torch.Tensor, p: torch.Tensor, w, eps: float, scalar, w_next, eps_next, nxt: bool):
    import triton

    from server.gpu_kernels import _summed_residual_norm
    from server.small_m_matmul import pdl_launch

    rows, n = residual.shape
    if p.dim() != 3 or p.shape[1:] != residual.shape:
        raise ValueError(f"partials {tuple(p.shape)} do not match a residual of {tuple(residual.shape)}")
    if residual.stride(-1) != 1 or p.stride(-1) != 1:
        raise ValueError("the residual norm kernel reads rows with unit column stride")
    h = torch.empty_like(residual, memory_format=torch.contiguous_format)
    x = torch.empty_like(h) if nxt else h
    if rows:
        block = triton.next_power_of_2(n)
        _summed_residual_norm[(rows,)](
            p, residual, w if w is not None else h, scalar if scalar is not None else h,
            w_next if w_next is not None else h, h, x, n, p.stride(0), p.stride(1), residual.stride(0),
            h.stride(0), x.stride(0), float(eps), float(eps_next if eps_next is not None else 0.0),
            SLICES=p.shape[0], HAS_W=w is not None, HAS_SCALAR=scalar is not None, NEXT=nxt,
            HAS_W_NEXT=w_next is not None, BLOCK=block, num_warps=_residual_warps(block),
            **pdl_launch(residual.device))
    return (h, x) if nxt else h


def _residual_warps(block: int) -> int:
    return RESIDUAL_NORM_WARPS or max(4, min(16, block // 256))


def summed_residual_norm(residual, p, w, eps, scalar):
    return _launch(residual, p, w, eps, scalar, None, None, False)


def summed_residual_norm_rms(residual, p, w, eps, scalar, w_next, eps_next):
    return _launch(residual, p, w, eps, scalar, w_next, eps_next, True)


def summed_qkv_norm_rope(pq, pk, pv, dtype, wq, eps_q, wk, eps_k, wv, eps_v, cos, sin):
    return _qkv_launch(pq, pk, pv, dtype, (wq, wk, wv), (eps_q, eps_k, eps_v), cos, sin)


def summed_norm_rope(pq, dtype, w, eps, cos, sin):
    return _qkv_launch(pq, None, None, dtype, (w, None, None), (eps, 0.0, 0.0), cos, sin)[0]


def _qkv_launch(pq, pk, pv, dtype, weights, eps, cos, sin):
    from server.gpu_kernels import _summed_qkv_norm_rope
    from server.small_m_matmul import pdl_launch

    slices, rows, heads, dim = pq.shape
    kv = pk is not None
    kv_heads = pk.shape[2] if kv else 0
    for part in (pq, pk, pv) if kv else (pq,):
        if (part.shape[0], part.shape[1], part.shape[3]) != (slices, rows, dim) or part.stride()[2:] != (dim, 1) \
                or (slices > 1 and part.stride(0) != pq.stride(0)) or (rows > 1 and part.stride(1) != pq.stride(1)):
            raise ValueError(f"partials {tuple(part.shape)} {part.stride()}: heads of {dim} contiguous values, "
                             "the slices and rows of q's partials")
    cos, sin = cos.reshape(rows, -1), sin.reshape(rows, -1)
    if cos.shape[1] != dim or sin.shape[1] != dim or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"cos / sin rows of {dim} contiguous values expected")
    q = torch.empty(rows, heads, dim, dtype=dtype, device=pq.device)
    k = torch.empty(rows, kv_heads, dim, dtype=dtype, device=pq.device) if kv else q
    v = torch.empty_like(k) if kv else q
    wq, wk, wv = weights
    if rows:
        _summed_qkv_norm_rope[(rows, heads + 2 * kv_heads)](
            pq, pk if kv else pq, pv if kv else pq, wq if wq is not None else q, wk if wk is not None else q,
            wv if wv is not None else q, cos, sin, q, k, v, pq.stride(0), pq.stride(1), cos.stride(0), sin.stride(0),
            float(eps[0]), float(eps[1]), float(eps[2]), heads, kv_heads, D=dim, SLICES=slices,
            HAS_WQ=wq is not None, HAS_WK=wk is not None, HAS_WV=wv is not None,
            num_warps=max(1, min(4, dim // 128)), **pdl_launch(pq.device))
    return q, k, v
