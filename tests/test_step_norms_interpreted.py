"""The step's norm kernels (server/step_norms.py; server/gpu_kernels.py `_summed_residual_norm`,
`_summed_qkv_norm_rope`) run by Triton's interpreter on the CPU against the fast path's ops as
written (server/fast_ops.py `_summed_residual_norm`, `_summed_residual_norm_rms`,
`_summed_qkv_norm_rope`, `_summed_norm_rope`): residual norms with and without the norms' weights,
the layer scalar and the next norm, 1 to 8 K slices, E4B's row width and one that is not a power of
two's; q / k / v norms with RoPE for a layer that owns its K/V (v without a weight, as Gemma 4's,
and with one), for one whose k and v are one projection, and for one that reads another's (q
alone); every norm with an epsilon of its own, large enough to move the values (one taken for
another fails); a row's bits the same whatever the other rows.

Why: CI has no GPU; this checks the kernel's arithmetic (the slices' sum in order, the two norms,
the roundings) on every CI run, and tests/test_fast_path.py runs whole steps with it on CUDA. The
interpreter computes in numpy, so these inputs are float32, where the kernel rounds nothing: the
same values as the ops to within float32's sums. Runs in a subprocess: TRITON_INTERPRET must be
set before the kernels are defined."""
from __future__ import annotations

import pytest

from tests.interpreted import interpreter_takes_numpy_2_scalars, run_interpreted

# (rows, slices, width, weights, scalar, next norm)
CASES = [
    (1, 8, 2560, True, False, True),
    (5, 8, 2560, True, False, False),
    (3, 2, 2560, True, True, True),
    (4, 1, 200, True, False, True),
    (2, 3, 200, False, True, True),
    (64, 2, 96, True, False, True),
]


# (rows, slices, q heads, kv heads (0: q alone; negative: k = v, one projection), head dim, v's norm weighted)
QKV_CASES = [(1, 8, 8, 2, 256, False), (3, 2, 4, 1, 128, True), (2, 1, 8, 0, 512, False), (16, 4, 2, 2, 64, False),
             (5, 2, 4, -1, 128, False)]


def test_norm_kernels_match_the_ops():
    pytest.importorskip("triton")
    out = run_interpreted(__file__)
    assert out.count("ok") == len(CASES) + len(QKV_CASES), out[-2000:]


def _main() -> int:
    import torch

    interpreter_takes_numpy_2_scalars()
    from server import step_norms
    from server.fast_ops import _EAGER_OPS

    for rows, slices, width, weights, scalar, nxt in CASES:
        g = torch.Generator().manual_seed(rows * 100 + slices * 10 + width)
        p = torch.randn(slices, rows, width, generator=g) * 3
        residual = torch.randn(rows, width, generator=g) * 10
        w = torch.rand(width, generator=g) + 0.5 if weights else None
        w_next = torch.rand(width, generator=g) + 0.5 if weights else None
        s = torch.tensor([0.7]) if scalar else None
        # epsilons large enough to move the values, and unlike: one taken for the other fails
        eps, eps_next = 0.5 * p.square().sum(0).mean().item(), 1e-6
        if nxt:
            want = _EAGER_OPS.summed_residual_norm_rms(residual, p, w, eps, s, w_next, eps_next)
            got = step_norms.summed_residual_norm_rms(residual, p, w, eps, s, w_next, eps_next)
        else:
            want = (_EAGER_OPS.summed_residual_norm(residual, p, w, eps, s),)
            got = (step_norms.summed_residual_norm(residual, p, w, eps, s),)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype
            err = (a - b).abs().max().item()
            assert err < 2e-5 * max(1.0, b.abs().max().item()), (rows, slices, width, err)
        # a row alone gets the bits it gets beside others (one program a row)
        last = rows - 1
        alone = (step_norms.summed_residual_norm_rms(residual[last:], p[:, last:].contiguous(), w, eps, s, w_next,
                                                     eps_next) if nxt
                 else (step_norms.summed_residual_norm(residual[last:], p[:, last:].contiguous(), w, eps, s),))
        for a, b in zip(alone, got):
            assert torch.equal(a[0], b[last]), (rows, slices, width)
        print("ok", rows, slices, width)

    for rows, slices, heads, kv_heads, dim, v_weight in QKV_CASES:
        g = torch.Generator().manual_seed(rows * 1000 + slices * 10 + dim)
        k_is_v = kv_heads < 0
        kv_heads = abs(kv_heads)
        widths = [heads * dim] + [kv_heads * dim] * ((1 if k_is_v else 2) if kv_heads else 0)
        partials = torch.randn(slices, rows, sum(widths), generator=g) * 2
        parts = [part.unflatten(-1, (-1, dim)) for part in partials.split(widths, -1)]
        if k_is_v:
            parts = parts + parts[1:]   # v is k's projection (server/fast_path.py: pkv * 2)
        table = torch.randn(rows, 3 * dim, generator=g)   # cos and sin: column views of one table's rows
        cos, sin = table[:, :dim][:, None, :], table[:, 2 * dim:][:, None, :]
        wq, wk = torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5
        wv = torch.rand(dim, generator=g) + 0.5 if v_weight else None
        # unlike epsilons that move the values (a head's mean square is about 4 * slices)
        eps_q, eps_k, eps_v = 2.0 * slices, 1e-6, 8.0 * slices

        def run(ops, lo):
            cut = [part[:, lo:] for part in parts]
            if kv_heads:
                return ops.summed_qkv_norm_rope(*cut, torch.float32, wq, eps_q, wk, eps_k, wv, eps_v,
                                                cos[lo:], sin[lo:])
            return (ops.summed_norm_rope(cut[0], torch.float32, wq, eps_q, cos[lo:], sin[lo:]),)

        got, want = run(step_norms, 0), run(_EAGER_OPS, 0)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape)
            err = (a - b).abs().max().item()
            assert err < 2e-5 * max(1.0, b.abs().max().item()), (rows, slices, heads, kv_heads, dim, err)
        for a, b in zip(run(step_norms, rows - 1), got):   # the last row alone: the same bits
            assert torch.equal(a[0], b[rows - 1]), (rows, slices, heads, kv_heads, dim)
        print("ok qkv", rows, slices, heads, kv_heads, dim, k_is_v, v_weight)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
