"""The fast path's int8 LM head (FastTarget(lm_head_int8=True), server/small_m_matmul.quantize_int8):
the quantization itself, the fast path's logits against transformers' forward on the same (dequantized)
head, the input embedding looked up on the host, drafted output equal to plain output, and the
planner's accounting. CPU tests run the head as its dequantized weights (no step kernels there); the
CUDA tests (skipped without a GPU) run the int8 step kernel, captured, and check batch invariance
and the GPU memory it frees."""
from __future__ import annotations

import copy

import pytest
import torch

from bench.fast_greedy import greedy_generate, oracle
from server.fast_memory import int8_head_saving
from server.fast_path import FastTarget, HostRowTable
from server.small_m_matmul import BLOCK_K, SmallMLinear, quantize_int8
from tests.test_engine_lossless import tiny_gemma4
from tests.test_fast_path import cuda_model, hf_logits, prompt_of

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def test_quantize_int8_layout_and_error():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(320, 384, generator=g) * torch.rand(320, 1, generator=g)).to(torch.bfloat16)
    w[5, :BLOCK_K] = 0  # an all-zero group: scale 0, codes 0, no division by zero
    lin = quantize_int8(w, rows_per_chunk=100)  # chunks that do not divide the rows
    assert lin.int8 and not lin.int4 and lin.weight.dtype == torch.int8 and lin.weight.shape == (384, 320)
    assert lin.scale.shape == (3, 320) and lin.scale.dtype == torch.bfloat16
    assert lin.weight.abs().max() <= 127 and lin.nbytes() == 384 * 320 + 3 * 320 * 2
    assert torch.equal(quantize_int8(w).weight, lin.weight)  # chunking changes nothing
    deq = lin.dequantize()
    assert deq.shape == w.shape and deq.dtype == torch.bfloat16
    assert torch.equal(deq[5, :BLOCK_K], torch.zeros(BLOCK_K, dtype=torch.bfloat16))
    step = lin.scale.float().repeat_interleave(BLOCK_K, 0).t()
    # half a quantization step, plus the bf16 rounding of the dequantized value
    assert ((deq.float() - w.float()).abs() <= step / 2 + w.float().abs() / 128 + 1e-6).all()
    # the largest |w| of each group is a code of +-127: the whole range is used
    codes = lin.weight.t().reshape(320, 3, BLOCK_K).abs().amax(-1)
    assert (codes[lin.scale.t() > 0] == 127).all()


def head_model():
    """A tiny Gemma 4 whose hidden size tiles the int8 kernel (K: 128) and whose head is tied."""
    model = tiny_gemma4(seed=4, hidden_size=128, intermediate_size=256)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def with_head(model, weight: torch.Tensor):
    """A copy of `model` whose LM head is `weight` (untied): transformers' forward, for reference."""
    ref = copy.deepcopy(model)
    ref.lm_head.weight = torch.nn.Parameter(weight.to(ref.lm_head.weight.dtype).clone(), requires_grad=False)
    ref.config.tie_word_embeddings = False
    return ref


def test_int8_head_matches_transformers_on_the_dequantized_head():
    model = head_model()
    want_head = quantize_int8(model.lm_head.weight.detach()).dequantize()
    ref = with_head(model, want_head)
    fast = FastTarget(model, max_len=128, prefill_chunk=16, capture=False, min_kv_len=16, lm_head_int8=True)
    assert fast.embed_on_host and isinstance(fast.embed, HostRowTable)
    assert hasattr(model.lm_head, "_sailfish_int8")
    ids = prompt_of(60, model.config.vocab_size, seed=2)
    want = hf_logits(ref, ids)
    torch.testing.assert_close(fast.prefill(ids[:33]).float(), want[32], rtol=1e-4, atol=1e-4)
    at = 33
    for n in (1, 4, 16, 6):  # steps read the embedding rows staged from the host table
        torch.testing.assert_close(fast.step(ids[at:at + n]).float(), want[at:at + n], rtol=1e-4, atol=1e-4)
        at += n
    # the head differs from the bf16 one by the quantization only
    plain = hf_logits(model, ids)
    assert 0 < (want - plain).abs().max() < 0.05 * plain.abs().max()


def drafted_equals_plain(fast, prompt_lens, n: int, wrong: float) -> tuple[list[int], list[int]]:
    """Greedy tokens with oracle drafts (a share `wrong` of them wrong) equal plain greedy tokens, in
    fewer steps, for a prompt of each length; returns the last (prompt, plain tokens)."""
    vocab = fast.cfg.vocab_size
    for seed, plen in enumerate(prompt_lens):
        prompt = prompt_of(plen, vocab, seed)
        plain, plain_steps = greedy_generate(fast, prompt, n)
        drafted, steps = greedy_generate(fast, prompt, n, oracle(plain, plen, wrong, vocab, seed))
        assert drafted == plain and steps < plain_steps
    return prompt, plain


def test_int8_head_drafted_equals_plain_and_later_fast_paths_keep_it():
    model = head_model()
    fast = FastTarget(model, max_len=256, prefill_chunk=16, capture=False, min_kv_len=32, lm_head_int8=True)
    prompt, plain = drafted_equals_plain(fast, (9, 50), 60, wrong=0.25)
    # A second fast path over the same model (a lane, a rebuilt engine) takes the int8 head the
    # first one made, even unasked: the bf16 head left the GPU.
    again = FastTarget(model, max_len=256, prefill_chunk=16, capture=False, min_kv_len=32)
    assert again.embed_on_host
    assert greedy_generate(again, prompt, 60)[0] == plain


@needs_cuda
def test_int8_head_cuda_frees_memory_and_stays_batch_invariant():
    model = cuda_model(torch.bfloat16, quant=True, seed=3)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    table_at = model.lm_head.weight.data_ptr()  # where the bf16 table sits on the GPU
    want_head = quantize_int8(model.lm_head.weight.detach()).dequantize()
    saving = int8_head_saving(model)
    head_bytes = model.lm_head.weight.numel() * 2
    assert saving == head_bytes - head_bytes // 2 - head_bytes // BLOCK_K
    fast = FastTarget(model, max_len=512, prefill_chunk=16, min_kv_len=64, lm_head_int8=True)
    assert fast.step_kernels and isinstance(fast.lm_head_step, SmallMLinear) and fast.lm_head_step.int8
    assert model.model.embed_tokens.weight.device.type == "cpu"
    assert int8_head_saving(model) == 0
    import gc
    gc.collect()  # no tensor on the GPU still holds the bf16 table (a stale alias would keep it there);
    # matched by address too: earlier tests' models of the same shape may still be alive in this process
    table = model.model.embed_tokens.weight
    assert not [t for t in gc.get_objects() if torch.is_tensor(t) and t.is_cuda and t.shape == table.shape
                and t.dtype == table.dtype and t.untyped_storage().data_ptr() == table_at]
    ids = prompt_of(230, model.config.vocab_size, seed=6)
    fast.prefill(ids[:150])
    batched = fast.step(ids[150:214]).float().clone()
    fast.rollback(64)
    singles = torch.stack([fast.step([t])[0].float().clone() for t in ids[150:214]])
    assert torch.equal(batched, singles)
    drafted_equals_plain(fast, (9, 100), 100, wrong=0.2)
    # the int8 kernel's product equals a dense product on the dequantized head, to rounding
    x = torch.randn(5, want_head.shape[1], device="cuda", dtype=torch.bfloat16)
    got, want = fast.lm_head_step(x).float(), (x.float() @ want_head.float().t())
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_the_int8_head_is_planned_only_where_it_saves_memory():
    from server.fast_memory import int8_head_unfit

    assert int8_head_unfit(tiny_gemma4(seed=1, hidden_size=128).to(torch.bfloat16)) is None
    assert "bf16" in int8_head_unfit(tiny_gemma4(seed=1, hidden_size=128))          # fp32: no step kernels
    assert "does not tile" in int8_head_unfit(tiny_gemma4(seed=1).to(torch.bfloat16))  # hidden 64


def test_warm_up_growth_of_the_cuda_context_comes_out_of_the_prefix_budget(monkeypatch):
    """After warm-up the CUDA context has grown past what the plan measured: the prefix cache's
    budget gives the difference back, and what it cannot is said with the flags that help."""
    from types import SimpleNamespace

    import server.fast_memory as fm
    from server.fast_memory import FastMemoryPlan, settle_after_warmup
    from server.prefix_store import PrefixStore

    GiB = 2**30
    monkeypatch.setattr(fm, "_warmed_up", False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (10 * GiB, 16 * GiB))  # 6 GiB used
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 5 * GiB)           # so 1 GiB outside
    plan = FastMemoryPlan(8192, GiB // 2, "", cap=6 * GiB, outside=GiB - GiB // 4)        # planned with 0.75
    fast = SimpleNamespace(device=torch.device("cuda"), store=PrefixStore(GiB // 2))
    note = settle_after_warmup(fast, plan)
    assert fast.store.budget == GiB // 4 and "gave back 0.25 GiB" in note and "past" not in note
    fast = SimpleNamespace(device=torch.device("cuda"), store=PrefixStore(GiB // 8))
    note = settle_after_warmup(fast, plan)
    assert fast.store.budget == 0 and "0.12 GiB past the 6.00 GiB cap" in note and "--gpu-memory-mb" in note
    assert settle_after_warmup(fast, FastMemoryPlan(8192, 0, "", outside=0)) == ""  # no cap: nothing to settle
    assert fm._warmed_up  # later plans in this process measure a context whose kernels are loaded
