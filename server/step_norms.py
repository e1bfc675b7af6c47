"""The step's residual norms as one Triton kernel a call, reading a split-K matmul's K slices.

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

Why: the compiled ops (inductor) are reductions that loop over the row, and read the slices again
in each of their passes (the sum of squares of y, then of h, then the stores): on E4B, 126 such
kernels a step at about 3.8 us each, 0.48 ms of a 3.4 ms one-token step on an H100. This kernel
holds the row in registers and reads the slices once. `RESIDUAL_NORM_KERNEL` in server/fast_path.py
switches it (A/B runs: `python -m bench.step_ab`).
"""
from __future__ import annotations

import torch


def _launch(residual: torch.Tensor, p: torch.Tensor, w, eps: float, scalar, w_next, eps_next, nxt: bool):
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
        block = triton_next_pow2(n)
        _summed_residual_norm[(rows,)](
            p, residual, w if w is not None else h, scalar if scalar is not None else h,
            w_next if w_next is not None else h, h, x, n, p.stride(0), p.stride(1), residual.stride(0),
            h.stride(0), x.stride(0), float(eps), float(eps_next if eps_next is not None else 0.0),
            SLICES=p.shape[0], HAS_W=w is not None, HAS_SCALAR=scalar is not None, NEXT=nxt,
            HAS_W_NEXT=w_next is not None, BLOCK=block, num_warps=max(4, min(16, block // 256)),
            **pdl_launch(residual.device))
    return (h, x) if nxt else h


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def summed_residual_norm(residual, p, w, eps, scalar):
    return _launch(residual, p, w, eps, scalar, None, None, False)


def summed_residual_norm_rms(residual, p, w, eps, scalar, w_next, eps_next):
    return _launch(residual, p, w, eps, scalar, w_next, eps_next, True)
