"""The step kernels' weight layout and the checks around them, without a GPU (server/small_m_matmul.py).
The kernels themselves run in tests/test_fast_path.py's CUDA tests and bench/small_m_bench.py."""
from __future__ import annotations

import torch

from server.fast_linears import DenseLinear
from server.fast_path import FastTarget
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


def random_int4_layout(n: int, k: int, seed: int):
    """Random int4 codes packed in the step kernels' layout, with bf16 scales and offsets."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(k // BLOCK_K, n, generator=g).to(torch.bfloat16)
    offset = torch.rand(k // BLOCK_K, n, generator=g).to(torch.bfloat16)
    return pack_codes(codes), scale, offset


def test_prefill_dequantization_equals_the_layout():
    """server/fast_prefill.py turns the step kernels' int4 codes into W^T for its dense GEMMs."""
    from server.fast_prefill import _dequant_codes

    n, k = 96, 3 * BLOCK_K
    qweight, scale, offset = random_int4_layout(n, k, seed=2)
    want = SmallMLinear(qweight, scale, offset, n, k).dequantize()
    assert torch.equal(_dequant_codes(qweight, scale, offset), want.t())


def test_prefill_dequantization_without_cuda_equals_the_layout():
    """SmallMLinear.dequantize_t (prefill's W^T, here its torch fallback) is dequantize() transposed."""
    n, k = 64, 2 * BLOCK_K
    lin = SmallMLinear(*random_int4_layout(n, k, seed=3), n, k)
    scratch = torch.zeros(n * k + 100, dtype=torch.bfloat16)
    assert torch.equal(lin.dequantize_t(scratch), lin.dequantize().t())
    assert lin.dequantize_t(scratch).data_ptr() == scratch.data_ptr()


def _reference_steps(monkeypatch):
    """Run FastTarget's step-kernel path on the CPU: the Triton kernels replaced by reference math
    (the same layout, dequantized; attention by the step forward's own masks), and quanto's CPU
    tinygemm read back by its CPU kernel. What this checks is the bookkeeping around the kernels."""
    import server.small_m_matmul as smm
    from server.fast_ops import _EAGER_OPS, _attention
    from server.step_attention import StepAttention

    def unpack_cpu(packed, out_features, in_features):
        ones = torch.ones((in_features // 32, out_features, 2), dtype=torch.bfloat16)
        ones[:, :, 1] = 8
        eye = torch.eye(in_features, dtype=torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(eye, packed, 32, ones).t().to(torch.int32).contiguous()

    def small_m(self, x, gelu_times=None):
        y = x.reshape(-1, self.k) @ self.dequantize().t()
        if self.epilogue == smm.GELU_PAIRS:
            gate, up = y.split(self.n // 2, -1)
            y = torch.nn.functional.gelu(gate, approximate="tanh") * up
        elif gelu_times is not None:
            y = torch.nn.functional.gelu(y, approximate="tanh") * gelu_times.reshape(-1, self.n)
        return y.reshape(*x.shape[:-1], self.out_features)

    def attention(self, q, kc, vc, kv_len, qpos, slot_pos, window, scaling, path=None, new_kv=None):
        # chain steps only here (a chain's path is each row's own prefix, which the mask below is)
        if new_kv is not None:  # the step's rows, which the kernel's launch writes: row j at slot qpos[0] + j
            slots = qpos[0] + torch.arange(q.shape[0])
            if slot_pos is not None:
                slots = slots % kc.shape[1]
            kc.index_copy_(1, slots, new_kv[0][:q.shape[0]].transpose(0, 1))
            vc.index_copy_(1, slots, new_kv[1][:q.shape[0]].transpose(0, 1))
        if slot_pos is None:
            kc, vc = kc[:, :kv_len], vc[:, :kv_len]
            mask = torch.arange(kv_len)[None, :] <= qpos[:, None]
        else:
            sp, qp = slot_pos[None, :], qpos[:, None]
            mask = (sp <= qp) & (sp > qp - window) & (sp >= 0)
        return _attention(q, kc, vc, mask, scaling, _EAGER_OPS.masked_softmax)

    def slices(self, x):
        # the summed slices' form (server/fast_path.py SUMMED_SLICES) of one K slice: y itself, [1, M, N]
        return small_m(self, x).reshape(1, -1, self.n)

    monkeypatch.setattr(smm, "unpack_tinygemm", unpack_cpu)
    monkeypatch.setattr(smm.SmallMLinear, "__call__", small_m)
    monkeypatch.setattr(smm.SmallMLinear, "slices", slices)
    monkeypatch.setattr(StepAttention, "__call__", attention)
    monkeypatch.setattr(FastTarget, "_want_step_kernels",
                        lambda self, asked: (False, "off (asked)") if asked is False else (True, "reference"))


def test_one_int4_layout_bookkeeping_on_the_cpu(monkeypatch):
    """Once a layer's step layout is built, its quanto tensors are gone (no live reference), the HF
    modules keep the layout (a second FastTarget reuses it, no copy), prefill through the shared
    scratch equals prefill through the dense copy bit for bit and the step path closely, prefill in
    pieces stays close to one piece, and a FastTarget without step kernels still runs on it."""
    import gc
    import weakref

    from optimum.quanto import freeze, qint4, quantize

    from server.fast_linears import ReleasedLinear
    from server.fast_prefill import keep_dense_weights

    _reference_steps(monkeypatch)
    model = tiny_gemma4(seed=3, sliding_window=8, dtype=torch.bfloat16, hidden_size=256, intermediate_size=256,
                        head_dim=128, global_head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                        hidden_size_per_layer_input=128, vocab_size=256, vocab_size_per_layer_input=256)
    quantize(model, weights=qint4, exclude=["lm_head"])
    freeze(model)
    tiny = [m.weight for m in model.modules() if type(getattr(m, "weight", None)).__name__ == "TinyGemmWeightQBitsTensor"]
    assert tiny, "quanto did not give tinygemm int4 on the CPU"
    quanto_bytes = sum(w._data._data.numel() * w._data._data.element_size() + w._scale_shift.numel() *
                       w._scale_shift.element_size() for w in tiny)
    refs = [weakref.ref(w._data._data) for w in tiny] + [weakref.ref(w._scale_shift) for w in tiny]
    del tiny
    ids = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(4)).tolist()

    fast = FastTarget(model, max_len=128, prefill_chunk=16, min_kv_len=16, capture=False)
    gc.collect()
    assert fast.step_kernels and fast.released_bytes == quanto_bytes
    assert all(r() is None for r in refs), "a quanto packed tensor is still alive"
    kinds = {type(lin).__name__ for layer in fast.layers for lin in (layer.q, layer.k, layer.v, layer.o, layer.gate,
                                                                    layer.up, layer.down) if lin is not None}
    assert "ReleasedLinear" in kinds and "Int4Linear" not in kinds, kinds  # (CPU tinygemm needs K >= 256)
    fused = [layer.step.qkv for layer in fast.layers if layer.step.qkv is not None]
    assert fused and isinstance(fast.layers[0].k, ReleasedLinear) and fast.layers[0].k.layout[0] is fused[0].weight
    assert "scratch" in fast.prefill_note and fast.prefill_scratch_bytes > 0
    last = fast.prefill(ids).float()
    fast.prefill(ids[:-1])
    step = fast.step(ids[-1:])[0].float()
    assert ((last - step).norm() / step.norm()) < 0.25

    again = FastTarget(model, max_len=128, prefill_chunk=16, min_kv_len=16, capture=False, prefill_rows=16)
    assert again.released_bytes == 0
    for a, b in zip(again.step_linears(), fast.step_linears()):
        assert a.int4 == b.int4 and (not a.int4 or a.weight.data_ptr() == b.weight.data_ptr())
    pieces = again.prefill(ids).float()
    assert ((pieces - last).norm() / last.norm()) < 0.1
    again.prefill_rows = fast.prefill_rows
    assert torch.equal(again.prefill(ids).float(), last)
    keep_dense_weights(again, True)
    assert torch.equal(again.prefill(ids).float(), last)  # the dense copy is the scratch's W^T, bit for bit

    plain = FastTarget(model, max_len=128, prefill_chunk=16, min_kv_len=16, capture=False, step_kernels=False)
    assert "released" in plain.step_kernel_note
    other = plain.prefill(ids).float()
    assert ((other - last).norm() / last.norm()) < 0.1


def test_wide_tiling_rule(monkeypatch):
    """server/small_m_matmul.py's choice of a Gluon launch's tiling (plain Python; the launch itself
    is CUDA-only, where tests/test_step_kernel_rows.py checks the bits): one row tile keeps the
    linear's own below WIDE_FROM_ROWS rows, from there on WIDE_TILING where it tiles N and N is at
    least WIDE_MIN_COLUMNS; None turns it off. Rows, not row tiles: 16 rows may go wide, one not."""
    from server import small_m_matmul

    def linear(n: int) -> SmallMLinear:
        k = 2 * BLOCK_K
        return SmallMLinear(pack_codes(torch.zeros(n, k, dtype=torch.int32)), torch.ones(k // BLOCK_K, n, dtype=torch.bfloat16),
                            torch.zeros(k // BLOCK_K, n, dtype=torch.bfloat16), n, k)

    monkeypatch.setattr(small_m_matmul, "WIDE_FROM_ROWS", 17)
    monkeypatch.setattr(small_m_matmul, "WIDE_TILING", (128, 4))
    monkeypatch.setattr(small_m_matmul, "WIDE_MIN_COLUMNS", 0)
    wide, odd = linear(20480), linear(64 * 3)   # 192 columns: no 128-column tiling
    assert [wide._gluon_tiling(m) for m in (1, 16, 17, 64)] == [(64, 4), (64, 4), (128, 4), (128, 4)]
    monkeypatch.setattr(small_m_matmul, "WIDE_FROM_ROWS", 9)   # within one row tile
    assert [wide._gluon_tiling(m) for m in (1, 8, 9, 16)] == [(64, 4), (64, 4), (128, 4), (128, 4)]
    assert odd._gluon_tiling(64) == (64, 4)
    monkeypatch.setattr(small_m_matmul, "WIDE_MIN_COLUMNS", 20481)
    assert wide._gluon_tiling(64) == (64, 4)
    monkeypatch.setattr(small_m_matmul, "WIDE_MIN_COLUMNS", 0)
    monkeypatch.setattr(small_m_matmul, "WIDE_FROM_ROWS", None)
    assert wide._gluon_tiling(64) == (64, 4)


def test_k_slice_plan():
    """server/small_m_matmul.py `_plan`: the fewest K slices (each a whole number of 128-feature
    groups) that give the target's programs. The plan never depends on the rows, so a linear's sums
    are the same at every row count."""
    from server.small_m_matmul import _plan

    e4b = {"qkv": (3072, 2560), "o": (2560, 2048), "gate|up": (20480, 2560), "down": (2560, 10240),
           "ple gate": (256, 2560), "lm head": (262144, 2560)}
    assert {name: _plan(n, k, 64, 264) for name, (n, k) in e4b.items()} == {
        "qkv": 10, "o": 8, "gate|up": 1, "down": 8, "ple gate": 20, "lm head": 1}
    assert {name: _plan(n, k, 64, 528) for name, (n, k) in e4b.items()} == {
        "qkv": 20, "o": 16, "gate|up": 2, "down": 16, "ple gate": 20, "lm head": 1}
    assert _plan(64, 3 * BLOCK_K, 64, 264) == 3   # a prime number of groups: all of them, one a slice


def test_memory_plan_counts_the_planned_k_slices(monkeypatch):
    """server/fast_memory.py sizes the split-K scratch from the K slices the linears will be planned
    with: on E4B's shape the sliding layers' q|k|v (10 slices x 64 rows x 3072 columns) by default
    (under the 16 MiB floor), a full layer's once a higher target splits it more."""
    import json
    from pathlib import Path

    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    from server import small_m_matmul
    from server.fast_memory import _split_k_bytes

    shape = Path(__file__).parents[1] / "bench/configs/gemma4-e4b-text-config.json"
    with torch.device("meta"):
        layers = Gemma4ForCausalLM(Gemma4TextConfig(**json.loads(shape.read_text()))).model.layers
    assert _split_k_bytes(layers, 2560, 256, 262144) == 10 * 64 * 3072 * 4
    # a higher target: 20 slices of a full layer's q|k|v (6,144 columns), the most of any linear
    monkeypatch.setattr(small_m_matmul, "TARGET_PROGRAMS", 1056)
    assert _split_k_bytes(layers, 2560, 256, 262144) == 20 * 64 * 6144 * 4
