"""The step kernels' weight layout and the checks around them, without a GPU (server/small_m_matmul.py).
The kernels themselves run in tests/test_fast_path.py's CUDA tests and bench/small_m_bench.py."""
from __future__ import annotations

import torch

from server.fast_path import DenseLinear, FastTarget
from server.small_m_matmul import BLOCK_K, SmallMLinear, concat, pack_codes, unpack_codes, unsupported_shape
from tests.test_engine_lossless import tiny_gemma4


def test_pack_layout_by_hand_and_round_trip():
    codes = torch.randint(0, 16, (64, 2 * BLOCK_K), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    q = pack_codes(codes)
    assert q.shape == (2 * BLOCK_K // 8, 64) and q.dtype == torch.int32
    # group b, word r, nibble j holds feature 128 b + 16 j + r
    for b, r, j, n in ((0, 0, 0, 0), (1, 5, 3, 7), (1, 15, 7, 63), (0, 9, 6, 31)):
        assert int((q[b * 16 + r, n] >> (4 * j)) & 0xF) == int(codes[n, BLOCK_K * b + 16 * j + r])
    assert torch.equal(unpack_codes(q), codes)


def test_dequantize_and_concat():
    g = torch.Generator().manual_seed(1)
    parts = []
    for n in (64, 128):
        codes = torch.randint(0, 16, (n, BLOCK_K), generator=g, dtype=torch.int32)
        scale = torch.rand(1, n, generator=g).to(torch.bfloat16)
        offset = torch.rand(1, n, generator=g).to(torch.bfloat16)
        parts.append(SmallMLinear(pack_codes(codes), scale, offset, n, BLOCK_K))
        want = (codes.float() * scale.float().t() + offset.float().t()).to(torch.bfloat16)
        assert torch.equal(parts[-1].dequantize(), want)
    both = concat(parts)
    assert both.n == 192 and torch.equal(both.dequantize(), torch.cat([p.dequantize() for p in parts]))
    dense = SmallMLinear.from_dense(torch.zeros(64, BLOCK_K, dtype=torch.bfloat16))
    assert concat([parts[0], dense]) is None  # int4 and dense do not mix


def test_unsupported_shapes_say_why():
    assert unsupported_shape(DenseLinear(torch.zeros(64, BLOCK_K, dtype=torch.bfloat16))) is None
    assert "float32" in unsupported_shape(DenseLinear(torch.zeros(64, BLOCK_K)))
    assert "tile" in unsupported_shape(DenseLinear(torch.zeros(64, 100, dtype=torch.bfloat16)))
    assert "tile" in unsupported_shape(DenseLinear(torch.zeros(48, BLOCK_K, dtype=torch.bfloat16)))


def test_cpu_fast_target_says_step_kernels_need_cuda():
    fast = FastTarget(tiny_gemma4(seed=1), max_len=64, capture=False)
    assert not fast.step_kernels and "CUDA" in fast.step_kernel_note


def test_prefill_dequantization_equals_the_layout():
    """server/fast_prefill.py turns the step kernels' int4 codes into W^T for its dense GEMMs."""
    from server.fast_prefill import _dequant_codes

    g = torch.Generator().manual_seed(2)
    n, k = 96, 3 * BLOCK_K
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(k // BLOCK_K, n, generator=g).to(torch.bfloat16)
    offset = torch.rand(k // BLOCK_K, n, generator=g).to(torch.bfloat16)
    want = SmallMLinear(pack_codes(codes), scale, offset, n, k).dequantize()
    assert torch.equal(_dequant_codes(pack_codes(codes), scale, offset), want.t())
