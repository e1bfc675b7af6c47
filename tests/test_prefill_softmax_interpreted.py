"""The GPU prefill's masked softmax (server/gpu_kernels.py `_prefill_softmax_kernel`, called by
server/fast_prefill.py `_softmax_rows`) run by Triton's interpreter on the CPU against torch's
softmax over the same causal and window masks: full and sliding blocks, a block whose keys start
before its queries' window, rows of fewer keys than one kernel block and of several blocks.

Why: CI has no GPU; this checks the kernel's mask arithmetic (which keys a row sees) and its
online max and sum. The interpreter does not emulate bfloat16, so scores are float32. Runs in a
subprocess: TRITON_INTERPRET must be set before the kernels are defined."""
from __future__ import annotations

import pytest

from tests.interpreted import interpreter_takes_numpy_2_scalars, run_interpreted

# (heads, t query rows, first query position, key0, keys S, window, scaling)
CASES = [
    (2, 5, 100, 0, 105, 0, 0.5),          # full layer: keys 0..104, queries 100..104
    (3, 7, 40, 20, 27, 0, 1.0),           # keys start at 20
    (2, 6, 3000, 2490, 516, 512, 1.0),    # sliding: each row sees its last 512 positions
    (1, 40, 2000, 1000, 1040, 0, 0.125),  # rows spanning two kernel blocks of keys
    (2, 9, 1500, 990, 519, 512, 2.0),     # sliding, the first keys visible to none but the first row
]


def test_prefill_softmax_matches_torch():
    pytest.importorskip("triton")
    out = run_interpreted(__file__)
    assert out.count("ok") == len(CASES), out[-2000:]


def _main() -> int:
    import torch

    interpreter_takes_numpy_2_scalars()
    from server.gpu_kernels import _prefill_softmax_kernel

    for heads, t, first, key0, S, window, scaling in CASES:
        g = torch.Generator().manual_seed(heads * 1000 + t)
        scores = torch.randn(heads, t, S, generator=g) * 4
        kp = torch.arange(key0, key0 + S)
        qp = torch.arange(first, first + t)
        mask = kp[None, :] <= qp[:, None]
        if window:
            mask &= kp[None, :] > qp[:, None] - window
        want = torch.softmax((scores * scaling).masked_fill(~mask, float("-inf")), -1)
        got = scores.clone()
        _prefill_softmax_kernel[(heads * t,)](got, got, S, t, first, key0, window, scaling, BLOCK=1024)
        err = (got - want).abs().max().item()
        assert err < 1e-6, (heads, t, first, key0, S, window, err)
        assert bool((got[~mask.expand_as(got)] == 0).all())  # keys a row cannot see get exactly 0
        print("ok", heads, t, S, window, err)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
