"""The GPU prefill's masked softmax (server/gpu_kernels.py `_prefill_softmax_kernel`, called by
server/fast_prefill.py `_softmax_rows`) run by Triton's interpreter on the CPU against torch's
softmax over the same causal and window masks: full and sliding blocks, a block whose keys start
before its queries' window, rows of fewer keys than one kernel block and of several blocks.

Why: CI has no GPU; this checks the kernel's mask arithmetic (which keys a row sees) and its
online max and sum (rows whose maxima sit in later key blocks), one bf16 case through
`_softmax_rows`, and `_attend`'s query blocks with the kernel against its mask path (the positions
it passes). Runs in a subprocess: TRITON_INTERPRET must be set before the kernels are defined."""
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
    (1, 3, 2100, 0, 2103, 512, 1.0),      # sliding, each row's visible keys start past the first block
    (1, 5, 2045, 0, 2050, 512, 1.0),      # ... and cross a block edge
    (4, 1, 3000, 0, 3001, 0, 1.0),        # one query (a KV-shared layer's last token), three blocks
    (1, 8, 3000, 0, 3008, 0, 1.0),        # full rows over three blocks
]
# _attend's blocks with the kernel against its mask path (keys at k0, queries at q0, window, budget
# small enough for several query blocks): (T, KV heads, group, D, keys, k0, q0, window)
ATTEND_CASES = [(40, 2, 2, 16, 60, 0, 20, None), (40, 2, 2, 16, 60, 0, 20, 8), (33, 1, 4, 16, 50, 100, 117, 5)]


def test_prefill_softmax_matches_torch():
    pytest.importorskip("triton")
    out = run_interpreted(__file__)
    assert out.count("ok") == len(CASES) + 1 + len(ATTEND_CASES), out[-2000:]


def _main() -> int:
    import torch

    interpreter_takes_numpy_2_scalars()
    from server.gpu_kernels import _prefill_softmax_kernel

    for heads, t, first, key0, S, window, scaling in CASES:
        g = torch.Generator().manual_seed(heads * 1000 + t)
        # a ramp puts rows' maxima in late blocks: the running max and sum must rescale
        scores = torch.randn(heads, t, S, generator=g) * 4 + torch.linspace(0, 6, S)
        mask = _mask(key0, S, first, t, window)
        want = torch.softmax((scores * scaling).masked_fill(~mask, float("-inf")), -1)
        got = scores.clone()
        _prefill_softmax_kernel[(heads * t,)](got, got, S, t, first, key0, window, scaling, BLOCK=1024)
        err = (got - want).abs().max().item()
        assert err < 1e-6, (heads, t, first, key0, S, window, err)
        assert bool((got[~mask.expand_as(got)] == 0).all())  # keys a row cannot see get exactly 0
        print("ok", heads, t, S, window, err)

    # bf16 through _softmax_rows (the GPU's dtype): within one bf16 step of the fp32 softmax
    from server.fast_prefill import _attend, _softmax_rows
    heads, t, first, key0, S, window, scaling = CASES[2]
    scores = (torch.randn(heads, t, S, generator=torch.Generator().manual_seed(5)) * 4).to(torch.bfloat16).float()
    want = torch.softmax(scores.masked_fill(~_mask(key0, S, first, t, window), float("-inf")), -1)
    got = _softmax_rows(scores.to(torch.bfloat16), t, first, key0, window, scaling).float()
    assert (got - want).abs().max().item() < 4e-3, (got - want).abs().max().item()  # 2^-8: a step at 0.5..1
    print("ok bf16")

    from server.fast_ops import _EAGER_OPS
    for T, kvh, group, D, S, k0, q0, window in ATTEND_CASES:
        g = torch.Generator().manual_seed(T + S)
        q = torch.randn(T, kvh * group, D, generator=g)
        keys, values = torch.randn(kvh, S, D, generator=g), torch.randn(kvh, S, D, generator=g)
        args = (_EAGER_OPS, q, keys, values, k0, q0, window, 0.25)
        got = _attend(*args, budget=kvh * group * 16 * 24, kernel_softmax=True)
        want = _attend(*args, budget=kvh * group * 16 * 24, kernel_softmax=False)
        assert (got - want).abs().max().item() < 1e-5, (T, S, window, (got - want).abs().max().item())
        print("ok attend", T, S, window)
    return 0


def _mask(key0, S, first, t, window):
    import torch
    kp, qp = torch.arange(key0, key0 + S), torch.arange(first, first + t)
    mask = kp[None, :] <= qp[:, None]
    return mask & (kp[None, :] > qp[:, None] - window) if window else mask


if __name__ == "__main__":
    raise SystemExit(_main())
