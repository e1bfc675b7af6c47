"""The GPU step matmul's kernel (server/gpu_kernels.py `_small_m_kernel`, via server/small_m_matmul.py)
run by Triton's interpreter on the CPU, against a float64 reference: dense weights, 1 to 64 rows,
split-K and not, inputs with a row stride wider than K (a column slice of a wider tensor).

Why: CI has no GPU, so tests/test_step_kernel_rows.py skips there; this checks the kernel's index
arithmetic (row tiles, K slices, the partials' sum in slice order, row strides) on every
CI run. The interpreter computes in numpy and does not emulate bfloat16, so the inputs are float32
and the int4 path runs with float32 scales (its bf16 bit-trick decoding is left to the CUDA tests);
the int8 path's decoding (code times its group's scale) runs here in float32. Runs in a subprocess:
TRITON_INTERPRET must be set before the kernels are defined.
"""
from __future__ import annotations

import sys

import pytest

from tests.interpreted import interpreter_takes_numpy_2_scalars, run_interpreted_shards

# (N, K, rows, split target): target_programs 1 keeps one K slice, 64 cuts K into several
CASES = [(n, k, m, target) for n, k in ((64, 256), (96, 512)) for m in (1, 5, 16, 40, 64) for target in (1, 64)]
# int8 codes with a scale per group of 128 features (server.small_m_matmul.quantize_int8: the LM head of small cards)
INT8_CASES = [(n, k, m, target) for n, k in ((64, 256), (96, 384)) for m in (1, 17, 64) for target in (1, 64)]
# int4 codes in the step layout with float32 scales and offsets (the interpreter has no bf16, so the
# magic-number decoding is the CUDA tests'): the per-group accumulators, every tile count
INT4_CASES = [(n, k, m, target) for n, k in ((64, 256), (96, 512)) for m in (1, 16, 33, 64) for target in (1, 64)]


# split-K with the sums left to the next kernel (SmallMLinear.slices; the step ops sum them), and one K slice
SLICES_CASES = [(64, 512, 1, 64), (96, 512, 20, 64), (96, 512, 33, 64), (64, 512, 50, 64), (96, 512, 64, 64),
                (64, 256, 7, 1)]
# the gelu epilogues (GELU_PAIRS: gate | up in one weight; GELU_TIMES: times a strided u), split-K and not
EPILOGUE_CASES = [(n, k, m, target) for n, k in ((128, 256), (192, 512)) for m in (1, 17, 40) for target in (1, 64)]
# the soft-capped LM head (SOFTCAP: tanh(y / cap) * cap in the store), dense and int8, split-K and not
SOFTCAP_CASES = [(n, k, m, target, kind) for n, k in ((64, 256), (96, 512)) for m in (1, 16, 33)
                 for target in (1, 64) for kind in ("dense", "int8")]


def test_small_m_kernel_rows_and_slices():
    pytest.importorskip("triton")
    out = "".join(run_interpreted_shards(__file__))  # its cases in two processes at once
    assert out.count("ok") == (len(CASES) + len(INT8_CASES) + len(INT4_CASES) + 4 * len(EPILOGUE_CASES)
                               + len(SLICES_CASES) + len(SOFTCAP_CASES)), out[-2000:]


def _main(shard: str = "0", shards: str = "1") -> int:
    """Every shards-th case from `shard` on (counted over all the lists in turn), "ok" printed for each."""
    import itertools

    import torch

    interpreter_takes_numpy_2_scalars()
    from server.small_m_matmul import SmallMLinear, pack_codes, quantize_int8, sum_slices

    counter = itertools.count()  # over all the lists in turn
    mine = lambda cases: [case for case in cases if next(counter) % int(shards) == int(shard)]
    for n, k, m, target in mine(CASES):
        g = torch.Generator().manual_seed(n + k + m)
        w = torch.randn(n, k, generator=g)
        lin = SmallMLinear(w, None, None, n, k, target_programs=target)
        wide = torch.randn(m, k + 8, generator=g)  # the input is wide[:, :k]: rows k + 8 apart
        got = lin(wide[:, :k])
        want = wide[:, :k].double() @ w.double().t()
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-5, (n, k, m, target, lin.split, err)
        assert target == 1 or lin.split > 1
        print("ok", n, k, m, lin.split)
    for n, k, m, target in mine(INT8_CASES):
        g = torch.Generator().manual_seed(7 * n + k + m)
        w = torch.randn(n, k, generator=g)
        lin = quantize_int8(w, rows_per_chunk=40)  # chunks that do not divide N: the column offsets
        lin = SmallMLinear(lin.weight, lin.scale, None, n, k, target_programs=target)
        assert lin.int8 and not lin.int4 and lin.weight.shape == (k, n)
        deq = lin.dequantize()
        assert ((deq - w).abs() <= lin.scale.repeat_interleave(128, 0).t() / 2 + 1e-6).all()  # half a step at most
        x = torch.randn(m, k, generator=g)
        got = lin(x)
        want = x.double() @ deq.double().t()
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-5, ("int8", n, k, m, target, lin.split, err)
        print("ok int8", n, k, m, lin.split)
    for n, k, m, target in mine(INT4_CASES):
        g = torch.Generator().manual_seed(11 * n + k + m)
        codes = torch.randint(0, 16, (n, k), generator=g)
        scale = torch.rand(k // 128, n, generator=g) * 0.1
        offset = -8 * scale + torch.randn(k // 128, n, generator=g) * 0.01
        lin = SmallMLinear(pack_codes(codes), scale, offset, n, k, target_programs=target)
        assert lin.int4 and not lin.magic
        x = torch.randn(m, k, generator=g)
        got = lin(x)
        want = x.double() @ lin.dequantize().double().t()
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-5, ("int4", n, k, m, target, lin.split, err)
        print("ok int4", n, k, m, lin.split)
    gelu = lambda a: 0.5 * a * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (a + 0.044715 * a ** 3)))
    for (n, k, m, target), kind in mine([(case, kind) for case in EPILOGUE_CASES for kind in ("dense", "int4")]):
        g = torch.Generator().manual_seed(13 * n + k + m)
        if kind == "dense":
            lin = SmallMLinear(torch.randn(n, k, generator=g) * 0.05, None, None, n, k, target_programs=target)
        else:  # the int4 words, scales and offsets read through the pairs' column mapping
            scale = torch.rand(k // 128, n, generator=g) * 0.01
            lin = SmallMLinear(pack_codes(torch.randint(0, 16, (n, k), generator=g)), scale, -8 * scale, n, k,
                               target_programs=target)
        x = torch.randn(m, k, generator=g)
        y = (x.double() @ lin.dequantize().double().t())
        pairs = lin.gelu_pairs()
        assert pairs.out_features == n // 2 and pairs.split == lin.split and lin.out_features == n
        got = pairs(x)
        want = gelu(y[:, :n // 2]) * y[:, n // 2:]
        err = ((got.double() - want).norm() / want.norm()).item()
        assert got.shape == (m, n // 2) and err < 1e-5, ("pairs", kind, n, k, m, target, lin.split, err)
        print("ok gelu pairs", kind, n, k, m, lin.split)
        u = torch.randn(m, 3, n, generator=g)[:, 1]   # a strided view, as the per-layer inputs' slice
        got = lin(x, gelu_times=u)
        want = gelu(y) * u.double()
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-5, ("times", kind, n, k, m, target, lin.split, err)
        print("ok gelu times", kind, n, k, m, lin.split)
    for n, k, m, target, kind in mine(SOFTCAP_CASES):
        g = torch.Generator().manual_seed(19 * n + k + m)
        w = torch.randn(n, k, generator=g) * 2   # logits of tens: tanh's curved part and its flat tails
        lin = quantize_int8(w) if kind == "int8" else SmallMLinear(w, None, None, n, k)
        lin = SmallMLinear(lin.weight, lin.scale, None, n, k, target_programs=target)
        capped = lin.softcapped(30.0)
        assert capped.split == lin.split and capped.out_features == n
        x = torch.randn(m, k, generator=g)
        y = x.double() @ lin.dequantize().double().t()
        got, want = capped(x).double(), torch.tanh(y / 30.0) * 30.0
        assert y.abs().max() > 60 and ((got - want).norm() / want.norm()).item() < 1e-5, ("softcap", kind, n, k, m)
        print("ok softcap", kind, n, k, m, lin.split)
    for n, k, m, target in mine(SLICES_CASES):
        # SmallMLinear.slices: the K slices' partials, [split, m, n] contiguous, no counter moved;
        # added in slice order (sum_slices, as the step ops add them) they are the launch's own sum
        g = torch.Generator().manual_seed(17 * n + k + m)
        lin = SmallMLinear(torch.randn(n, k, generator=g), None, None, n, k, target_programs=target)
        x = torch.randn(m, k, generator=g)
        want = lin(x)
        if lin.split > 1:
            lin.partial.fill_(float("nan"))
        p = lin.slices(x)
        assert p.shape == (lin.split, m, n) and p.is_contiguous(), (p.shape, lin.split)
        assert torch.equal(sum_slices(p, x.dtype), want) and not lin.count.any(), ("slices", n, k, m)
        width = k // lin.split
        for s in range(lin.split):   # slice s is the product over K slice s, wherever the rows' tiles are
            ks = slice(s * width, (s + 1) * width)
            ref = x[:, ks].double() @ lin.weight[:, ks].double().t()
            assert ((p[s].double() - ref).norm() / ref.norm()).item() < 1e-5, ("slice", s, n, k, m)
        print("ok slices", n, k, m, lin.split)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(*sys.argv[1:]))
