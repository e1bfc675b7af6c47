"""The step attention's merge folded into its partials' launch (server/step_attention.py FOLD_MERGE),
in whole steps on CUDA: the logits are the bits of steps with the merge kernel, and drafted output is
plain output. The kernels themselves: tests/test_step_kernel_rows.py (CUDA) and, under Triton's
interpreter on the CPU, tests/test_step_attention_interpreted.py and test_stacked_step_interpreted.py."""
from __future__ import annotations

import pytest
import torch

from tests.test_fast_path import cuda_model, needs_cuda, prompt_of


@needs_cuda
@pytest.mark.parametrize("quant", [False, True])
def test_steps_with_the_folded_merge_give_the_same_bits_cuda(quant, monkeypatch):
    from bench.fast_greedy import greedy_generate, oracle
    from server import fast_path, step_attention

    model = cuda_model(torch.bfloat16, quant=quant)
    vocab = model.config.vocab_size
    ids = prompt_of(120, vocab, seed=4)
    logits, targets = {}, {}
    for fold in (False, True):
        monkeypatch.setattr(step_attention, "FOLD_MERGE", fold)
        fast = fast_path.FastTarget(model, max_len=512, prefill_chunk=16, min_kv_len=64)
        assert fast.step_kernels, fast.step_kernel_note
        assert all(a.fold == fold for a in fast.step_attention.values())
        fast.prefill(ids[:40])
        logits[fold] = [fast.step(ids[40:41]).float().clone(), fast.step(ids[41:57]).float().clone(),
                        fast.step(ids[57:121]).float().clone()]
        targets[fold] = fast
    assert all(torch.equal(a, b) for a, b in zip(logits[False], logits[True]))
    fast = targets[True]
    for seed, plen in ((1, 9), (3, 100)):
        prompt = prompt_of(plen, vocab, seed)
        plain, plain_steps = greedy_generate(fast, prompt, 100)
        drafted, steps = greedy_generate(fast, prompt, 100, oracle(plain, plen, 0.2, vocab, seed))
        assert drafted == plain and steps < plain_steps
