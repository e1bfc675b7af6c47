"""The step's norm kernels (server/step_norms.py) on CUDA: against the fast path's ops as written in
bf16 (within bf16 rounding), a row's bits the same at every row count, and whole steps with them
against steps on the compiled ops (RESIDUAL_NORM_KERNEL, QKV_NORM_KERNEL off), and with both on
(whatever the defaults) a verify's logits equal one-token steps' and drafted output equals plain. The kernels'
arithmetic on the CPU is tests/test_step_norms_interpreted.py's."""
from __future__ import annotations

import pytest
import torch

from tests.test_fast_path import cuda_model, needs_cuda, prompt_of


@needs_cuda
@pytest.mark.parametrize("slices", [1, 2, 8])
def test_residual_norm_kernel_bf16_cuda(slices):
    from server import step_norms
    from server.fast_ops import _EAGER_OPS

    g = torch.Generator(device="cuda").manual_seed(slices)
    rows, width = 64, 2560
    p = torch.randn(slices, rows, width, device="cuda", generator=g) * 3
    if slices == 1:  # one slice: the linear's own bf16 output (small_m_matmul `slices`)
        p = p.bfloat16()
    residual = (torch.randn(rows, width, device="cuda", generator=g) * 10).bfloat16()
    w, w_next = ((torch.rand(width, device="cuda", generator=g) + 0.5).bfloat16() for _ in range(2))
    scalar = torch.tensor([0.7], device="cuda").bfloat16()
    got = step_norms.summed_residual_norm_rms(residual, p, w, 1e-6, scalar, w_next, 1e-6)
    want = _EAGER_OPS.summed_residual_norm_rms(residual, p, w, 1e-6, scalar, w_next, 1e-6)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        assert _close_bf16(a, b)
        assert (a != b).float().mean() < 0.05
    for n in (1, 2, 5, 16, 33):  # a row's bits whatever the rows beside it
        part = step_norms.summed_residual_norm_rms(residual[-n:], p[:, -n:], w, 1e-6, scalar, w_next, 1e-6)
        assert all(torch.equal(a, b[-n:]) for a, b in zip(part, got)), n
    h = step_norms.summed_residual_norm(residual, p, w, 1e-6, None)   # without the next norm
    ref = _EAGER_OPS.summed_residual_norm(residual, p, w, 1e-6, None)
    assert _close_bf16(h, ref)


def _close_bf16(a, b):
    """Within a bf16 step or two: a sum of squares in another order moves a value by at most that."""
    return ((a.float() - b.float()).abs() <= 2 ** -6 * b.float().abs() + 1e-3).all()


@needs_cuda
@pytest.mark.parametrize("slices,kv_heads,dim", [(8, 2, 256), (1, 2, 512), (4, 0, 256)])
def test_qkv_norm_kernel_bf16_cuda(slices, kv_heads, dim):
    from server import step_norms
    from server.fast_ops import _EAGER_OPS

    g = torch.Generator(device="cuda").manual_seed(slices + dim)
    rows, heads = 64, 8
    widths = [heads * dim] + [kv_heads * dim] * (2 if kv_heads else 0)
    partials = torch.randn(slices, rows, sum(widths), device="cuda", generator=g) * 2
    if slices == 1:
        partials = partials.bfloat16()
    parts = [part.unflatten(-1, (-1, dim)) for part in partials.split(widths, -1)]
    table = torch.randn(rows, 2 * dim, device="cuda", generator=g).bfloat16()
    cos, sin = table[:, :dim][:, None, :], table[:, dim:][:, None, :]
    wq, wk = ((torch.rand(dim, device="cuda", generator=g) + 0.5).bfloat16() for _ in range(2))

    def run_with(ops, cos, sin, lo=0):
        cut = [part[:, lo:] for part in parts]
        if kv_heads:
            return ops.summed_qkv_norm_rope(*cut, torch.bfloat16, wq, 1e-6, wk, 1e-6, None, 1e-6, cos[lo:], sin[lo:])
        return (ops.summed_norm_rope(cut[0], torch.bfloat16, wq, 1e-6, cos[lo:], sin[lo:]),)

    def run(ops, lo):
        return run_with(ops, cos, sin, lo)

    got = run(step_norms, 0)
    want = run(_EAGER_OPS, 0)
    # The rotation's terms, each as the ops round it: the normed head alone (cos 1, sin 0) and its
    # rotated half alone (cos 0, sin 1). The kernel's x * cos + rotate_half(x) * sin is one rounding
    # short of the ops' (the compiler contracts a product and the sum into one bf16 fma: fma.rn.bf16x2
    # in its sm_90 PTX), so where the terms cancel, an output's error is a step of the terms', not of
    # its own; a wrong rotation errs by the terms themselves.
    ones, zeros = torch.ones_like(cos), torch.zeros_like(cos)
    terms = [(a.float().abs() * cos.float().abs() + b.float().abs() * sin.float().abs())
             for a, b in zip(run_with(_EAGER_OPS, ones, zeros), run_with(_EAGER_OPS, zeros, ones))]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        if kv_heads and i == 2:   # v: normed, not rotated
            assert _close_bf16(a, b)
        else:
            assert ((a.float() - b.float()).abs() <= 2 ** -6 * (terms[i] + b.float().abs()) + 1e-3).all()
    for n in (1, 2, 5, 16, 33):  # a row's bits whatever the rows beside it
        assert all(torch.equal(a, b[-n:]) for a, b in zip(run(step_norms, rows - n), got)), n


@needs_cuda
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("switch", ["RESIDUAL_NORM_KERNEL", "QKV_NORM_KERNEL"])
def test_steps_with_the_norm_kernels_close_to_the_compiled_ops_cuda(quant, switch, monkeypatch):
    """Whole steps (1 to 16 rows) with a kernel and with the compiled ops: the same model to
    within rounding; and the kernel is the one that runs (the fast path says so)."""
    from server import fast_path

    model = cuda_model(torch.bfloat16, quant=quant)
    ids = prompt_of(80, model.config.vocab_size, seed=9)
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(fast_path, switch, on)
        fast = fast_path.FastTarget(model, max_len=256, prefill_chunk=16, min_kv_len=64)
        running = fast.norm_kernel if switch == "RESIDUAL_NORM_KERNEL" else fast.qkv_kernel
        assert fast.step_kernels and fast.summed_slices and running == on, fast.step_kernel_note
        fast.prefill(ids[:20])
        logits[on] = torch.cat([fast.step(ids[20:21]).float(), fast.step(ids[21:37]).float()])
    # two roundings of a random bf16 net differ by ~0.1 (tests/test_fast_path.py); a wrong norm gives ~1
    rel = (logits[True] - logits[False]).norm() / logits[False].norm()
    assert rel < 0.25, rel


@needs_cuda
@pytest.mark.parametrize("quant", [False, True])
def test_drafted_equals_plain_with_the_norm_kernels_cuda(quant, monkeypatch):
    """With both kernels on, whatever the defaults: a 64-token step's logits are the bits of 64
    one-token steps', and drafted greedy output is plain greedy output, token for token."""
    from bench.fast_greedy import greedy_generate, oracle
    from server import fast_path

    monkeypatch.setattr(fast_path, "RESIDUAL_NORM_KERNEL", True)
    monkeypatch.setattr(fast_path, "QKV_NORM_KERNEL", True)
    model = cuda_model(torch.bfloat16, quant=quant)
    vocab = model.config.vocab_size
    fast = fast_path.FastTarget(model, max_len=512, prefill_chunk=16, min_kv_len=64)
    assert fast.norm_kernel and fast.qkv_kernel, fast.step_kernel_note
    ids = prompt_of(230, vocab, seed=6)
    fast.prefill(ids[:150])
    batched = fast.step(ids[150:214]).float().clone()
    fast.rollback(64)
    singles = torch.stack([fast.step([t])[0].float().clone() for t in ids[150:214]])
    assert torch.equal(batched, singles)
    for seed, plen in ((0, 9), (2, 100)):
        prompt = prompt_of(plen, vocab, seed)
        plain, plain_steps = greedy_generate(fast, prompt, 120)
        drafted, steps = greedy_generate(fast, prompt, 120, oracle(plain, plen, 0.2, vocab, seed))
        assert drafted == plain and steps < plain_steps
