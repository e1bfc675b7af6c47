"""The fast path's summed step ops (server/fast_ops.py `_summed_*`), which read a split-K matmul's K
slices (server/small_m_matmul.py `slices`) and sum them in the op's own compiled kernel:

- the sum is rounded to bfloat16 as the matmul rounds its output, compiled or not: inside a
  compiled kernel inductor drops a downcast that an upcast undoes, `round_to_bfloat16` it keeps
  (against torch's own rounding, with inf, NaN and -0 among the values);
- each op is one compilation for steps of every size (one per slice count, which a linear's
  shape fixes), so a row's bits never depend on the others (counted with a recording backend);
- each is the op on the rounded sum to within bf16 rounding (inductor picks anew which values of
  a fused op it keeps in bf16, so not bit for bit), compiled by inductor on the CPU.

CI has no GPU; tests/test_fast_path.py runs whole steps with and without them on CUDA."""
from __future__ import annotations

import pytest
import torch

from server import fast_ops
from server.small_m_matmul import round_to_bfloat16, sum_slices


@pytest.fixture(scope="module")
def ops():
    torch._dynamo.reset()
    yield fast_ops.compile_ops()
    torch._dynamo.reset()


def test_round_to_bfloat16_is_torchs_rounding(ops):
    g = torch.Generator().manual_seed(0)
    y = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-30, 30, (4096,), generator=g),
                   torch.tensor([float("inf"), float("-inf"), -0.0, 0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])])
    want = y.bfloat16().float()
    assert torch.equal(round_to_bfloat16(y), want)
    assert round_to_bfloat16(torch.tensor([float("nan")])).isnan().all()
    compiled = torch.compile(lambda t: round_to_bfloat16(t) * 1.0, dynamic=True)
    assert torch.equal(compiled(y), want)
    # what the function is for: a plain round trip inside a compiled kernel is elided
    assert not torch.equal(torch.compile(lambda t: t.bfloat16().float() * 1.0, dynamic=True)(y), want)


@pytest.mark.parametrize("slices", [2, 3, 8])
def test_compiled_sum_is_the_ordered_rounded_sum(ops, slices):
    """Inside a compiled kernel, sum_slices adds the slices in order from the first and rounds once:
    the eager loop's bits."""
    g = torch.Generator().manual_seed(slices)
    p = torch.randn(slices, 64, 1024, generator=g) * 10.0 ** torch.randint(-3, 4, (slices, 64, 1024), generator=g)
    p[:, 0, 0] = 0.0
    p[:3, 0, 0] = torch.tensor([1e8, -1e8, 1.0])[:slices]   # in order 1; from the last slice back, 0
    total = p[0].clone()
    for s in range(1, slices):
        total += p[s]
    want = total.bfloat16().float()
    compiled = torch.compile(lambda t: sum_slices(t, torch.bfloat16).float() * 1.0, dynamic=True)
    assert torch.equal(compiled(p), want)
    # and the check can tell: the unrounded sum, and past two slices the reversed order, differ
    assert not torch.equal(total, want)
    if slices > 2:
        reversed_total = p[-1].clone()
        for s in range(slices - 2, -1, -1):
            reversed_total += p[s]
        assert not torch.equal(reversed_total.bfloat16().float(), want)


def _cases(slices: int, T: int, seed: int = 0):
    """(summed op, its arguments, the plain op, its arguments on the rounded sum) for each summed op."""
    g = torch.Generator().manual_seed(seed)
    N, H, D = 256, 4, 64
    bf = lambda *shape: torch.randn(*shape, generator=g).bfloat16()
    p = torch.randn(slices, T, N, generator=g) * 3
    if slices == 1:  # one K slice: the matmul's output itself, already bf16
        p = p.bfloat16()
    y = sum_slices(p, torch.bfloat16)
    h, w, w2 = bf(T, N), bf(N), bf(N)
    pq, pk, pv = (t.unflatten(-1, (heads, D)) for t, heads in zip(p.split((H * D // 2, D, D), -1), (H // 2, 1, 1)))
    if seed % 2:   # a layer whose values are its keys (q|k only): one tensor passed as both
        pv = pk
    yq, yk, yv = (sum_slices(t, torch.bfloat16) for t in (pq, pk, pv))
    cos, sin, wq, wk = bf(T, 1, D), bf(T, 1, D), bf(D), bf(D)
    pp = p.unflatten(-1, (4, N // 4))   # the per-layer inputs: [S, T, layers, per-layer size]
    tok, scale, wp = bf(T, 4, N // 4), torch.tensor(0.5, dtype=torch.bfloat16), bf(N // 4)
    return [("residual_norm_rms", (h, p, w, 1e-6, None, w2, 1e-6), (h, y, w, 1e-6, None, w2, 1e-6)),
            ("residual_norm", (h, p, w, 1e-6, None), (h, y, w, 1e-6, None)),
            ("qkv_norm_rope", (pq, pk, pv, torch.bfloat16, wq, 1e-6, wk, 1e-6, None, 1e-6, cos, sin),
             (yq, yk, yv, wq, 1e-6, wk, 1e-6, None, 1e-6, cos, sin)),
            ("norm_rope", (pq, torch.bfloat16, wq, 1e-6, cos, sin), (yq, wq, 1e-6, cos, sin)),
            ("ple_inputs", (pp, scale, wp, 1e-6, tok, scale), (sum_slices(pp, torch.bfloat16), scale, wp, 1e-6, tok, scale))]


# one slice (no split) and several: each count is an inductor compilation of every op on the CPU, about
# 25 s of CI (2 slices took the same path as 8; whole steps on CUDA, tests/test_fast_path.py, run the
# counts their linears take)
@pytest.mark.parametrize("slices", [1, 8])
def test_summed_ops_are_the_ops_on_the_rounded_sum(ops, slices):
    for name, summed_args, plain_args in _cases(slices, T=5, seed=slices):
        got, want = getattr(ops, "summed_" + name)(*summed_args), getattr(ops, name)(*plain_args)
        for a, b in zip(*((t,) if isinstance(t, torch.Tensor) else t for t in (got, want))):
            assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape, name
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=2 ** -6, msg=name)


def test_one_compilation_per_op_and_slice_count_for_every_step_size():
    compilations: list[str] = []

    def counting(gm, example_inputs):
        compilations.append(str(gm.code))
        return gm.forward

    torch._dynamo.reset()
    try:
        ops = fast_ops.compile_ops(backend=counting)
        for slices in (8, 2, 10):
            for T in (2, 16, 4, 64, 8, 32, 3):  # step sizes, the padding-free ones of a segmented forward among them
                for name, summed_args, _ in _cases(slices, T):
                    getattr(ops, "summed_" + name)(*summed_args)
        assert len(compilations) == 3 * 5, f"{len(compilations)} compilations for 5 ops at 3 slice counts"
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("slices", [1, 2, 8])
def test_summed_rope_reads_the_rotated_partials_with_the_stored_sums_bits(slices):
    """The summed q/k ops take RoPE's rotated half from the rotated partials (one kernel, not a second
    reading the normed values back): run eagerly, every intermediate rounded as a store rounds it,
    they give the bits of the plain ops on the stored sum, with and without a norm weight, at
    values across magnitudes (negative zeros and ties to even among the roundings)."""
    g = torch.Generator().manual_seed(slices)
    T, H, D = 7, 3, 64
    p = torch.randn(slices, T, H, D, generator=g) * 10.0 ** torch.randint(-3, 4, (slices, T, H, D), generator=g)
    if slices == 1:
        p = p.bfloat16()
    cos, sin = (torch.randn(T, 1, D, generator=g).bfloat16() for _ in range(2))
    y = sum_slices(p, torch.bfloat16)
    for w in (torch.randn(D, generator=g).bfloat16(), None):
        got = fast_ops._summed_norm_rope(p, torch.bfloat16, w, 1e-6, cos, sin)
        assert torch.equal(got, fast_ops._norm_rope(y, w, 1e-6, cos, sin))
    q, k, v = fast_ops._summed_qkv_norm_rope(p, p[:, :, :1], p[:, :, 1:2], torch.bfloat16, w, 1e-6, w, 1e-6,
                                              None, 1e-6, cos, sin)
    want = fast_ops._qkv_norm_rope(y, y[:, :1], y[:, 1:2], w, 1e-6, w, 1e-6, None, 1e-6, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), want))
