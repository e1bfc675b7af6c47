"""The step's norm kernels (server/step_norms.py; server/gpu_kernels.py `_summed_residual_norm`,
`_summed_qkv_norm_rope`) run by Triton's interpreter on the CPU against the fast path's ops as
written (server/fast_ops.py `_summed_residual_norm`, `_summed_residual_norm_rms`,
`_summed_qkv_norm_rope`, `_summed_norm_rope`): residual norms with and without the norms' weights,
the layer scalar and the next norm, 1 to 8 K slices, E4B's row width and one that is not a power of
two's; q / k / v norms with RoPE for a layer that owns its K/V (v without a weight, as Gemma 4's)
and for one that reads another's (q alone); a row's bits the same whatever the other rows.

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


# (rows, slices, q heads, kv heads (0: q alone), head dim)
QKV_CASES = [(1, 8, 8, 2, 256), (3, 2, 4, 1, 128), (2, 1, 8, 0, 512), (16, 4, 2, 2, 64)]


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
        if nxt:
            want = _EAGER_OPS.summed_residual_norm_rms(residual, p, w, 1e-6, s, w_next, 1e-5)
            got = step_norms.summed_residual_norm_rms(residual, p, w, 1e-6, s, w_next, 1e-5)
        else:
            want = (_EAGER_OPS.summed_residual_norm(residual, p, w, 1e-6, s),)
            got = (step_norms.summed_residual_norm(residual, p, w, 1e-6, s),)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype
            err = (a - b).abs().max().item()
            assert err < 2e-5 * max(1.0, b.abs().max().item()), (rows, slices, width, err)
        # a row alone gets the bits it gets beside others (one program a row)
        last = rows - 1
        alone = (step_norms.summed_residual_norm_rms(residual[last:], p[:, last:], w, 1e-6, s, w_next, 1e-5) if nxt
                 else (step_norms.summed_residual_norm(residual[last:], p[:, last:], w, 1e-6, s),))
        for a, b in zip(alone, got):
            assert torch.equal(a[0], b[last]), (rows, slices, width)
        print("ok", rows, slices, width)

    for rows, slices, heads, kv_heads, dim in QKV_CASES:
        g = torch.Generator().manual_seed(rows * 1000 + slices * 10 + dim)
        widths = [heads * dim] + [kv_heads * dim] * (2 if kv_heads else 0)
        partials = torch.randn(slices, rows, sum(widths), generator=g) * 2
        parts = [part.unflatten(-1, (-1, dim)) for part in partials.split(widths, -1)]
        table = torch.randn(rows, 3 * dim, generator=g)   # cos and sin: column views of one table's rows
        cos, sin = table[:, :dim][:, None, :], table[:, 2 * dim:][:, None, :]
        wq, wk = torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5

        def run(ops, lo):
            cut = [part[:, lo:] for part in parts]
            if kv_heads:
                return ops.summed_qkv_norm_rope(*cut, torch.float32, wq, 1e-6, wk, 1e-5, None, 1e-6,
                                                cos[lo:], sin[lo:])
            return (ops.summed_norm_rope(cut[0], torch.float32, wq, 1e-6, cos[lo:], sin[lo:]),)

        got, want = run(step_norms, 0), run(_EAGER_OPS, 0)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape)
            err = (a - b).abs().max().item()
            assert err < 2e-5 * max(1.0, b.abs().max().item()), (rows, slices, heads, kv_heads, dim, err)
        for a, b in zip(run(step_norms, rows - 1), got):   # the last row alone: the same bits
            assert torch.equal(a[0], b[rows - 1]), (rows, slices, heads, kv_heads, dim)
        print("ok qkv", rows, slices, heads, kv_heads, dim)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
