"""Plain greedy steps chained on the device (server/fast_path.py `step_after_argmax`, server/engine.py
`_complete`): the next one-token step is launched from the argmax the step before left on the
GPU, before the host reads it, so the GPU does not wait for the host between steps.

Nothing a caller sees may change. On the CPU (CI) the engine's side runs on an uncaptured fast
path told that it chains (its `step_after_argmax` is then the plain sequence: argmax, then a
step), so the bookkeeping is what is tested: the same tokens, text, finish and counters as the
unchained engine, the launched step rolled back where a request ends (stop token, stop string,
max_tokens), and the same cached prefix for the next turn. Requests that must not chain (drafts,
sampling, penalties) do not. On CUDA the device chain itself: token for token and bit for bit the
logits of `row_argmax` followed by `step`, and whole requests through the engine."""
from __future__ import annotations

import pytest
import torch

from server.fast_path import FastTarget
from tests.test_early_launch import _same
from tests.test_engine_lossless import IdTokenizer, OracleWithErrors, engine_for, prompts_for, run, tiny_gemma4


@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma4(seed=3)


def _counting(fast: FastTarget) -> list:
    """Count `fast`'s step_after_argmax calls (the list's length)."""
    calls, inner = [], fast.step_after_argmax

    def counted(logits):
        calls.append(1)
        return inner(logits)
    fast.step_after_argmax = counted
    return calls


class _SaysItChains(FastTarget):
    """An uncaptured target (CPU) that tells the engine it chains: its step_after_argmax is the
    plain sequence, so the engine's chained bookkeeping runs on the CPU."""
    chains_steps = True


def test_chained_and_unchained_engines_give_the_same_requests(tiny):
    vocab = tiny.config.vocab_size
    requests = {
        "greedy": lambda plain: dict(max_tokens=40, draft=False),
        "stop token": lambda plain: dict(max_tokens=40, draft=False, stop_token_ids=frozenset({plain[17]})),
        "stop string": lambda plain: dict(max_tokens=40, draft=False, stop_strings=(f"<{plain[9]}><{plain[10]}>",)),
        "max_tokens": lambda plain: dict(max_tokens=7, draft=False),
        "one token": lambda plain: dict(max_tokens=1, draft=False),
        # these never chain: the next step's input is not the raw argmax, or it carries a draft
        "sampled": lambda plain: dict(max_tokens=30, draft=False, temperature=0.9, seed=5),
        "penalized": lambda plain: dict(max_tokens=30, draft=False, repetition_penalty=1.3),
        "drafted": lambda plain: dict(max_tokens=30),
    }
    for seed, prompt in enumerate(prompts_for(vocab, (6, 30))):
        plain, *_ = run(engine_for(tiny, IdTokenizer()), prompt, max_tokens=40, draft=False)
        for what, params in requests.items():
            fasts = [cls(tiny, max_len=256, prefill_chunk=16, capture=False, min_kv_len=16, prefix_budget_bytes=2**24)
                     for cls in (_SaysItChains, FastTarget)]
            calls = [_counting(fast) for fast in fasts]
            engines = [engine_for(tiny, IdTokenizer(), backend=fast, launch_early=True,
                                  drafter=OracleWithErrors(len(prompt), plain, vocab, 0.3, seed)) for fast in fasts]
            got = [run(engine, prompt, **params(plain)) for engine in engines]
            _same(*got, (what, seed))
            chained = len(calls[0])
            if what in ("sampled", "penalized", "drafted", "one token"):
                assert chained == 0, what
            else:  # every plain step, but not the one that makes the max_tokens-th token
                steps = got[0][3].plain_steps
                assert 0 < chained == (steps - 1 if got[0][2] == "length" else steps), (what, chained, steps)
            assert not calls[1]
            # the state the request left: a next turn resumes from the same cached prefix
            turn = prompt + got[0][0][:5] + [7, 8]
            _same(*[run(engine, turn, max_tokens=5, draft=False) for engine in engines], (what, "next turn"))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("quant", [False, True])
def test_device_chain_equals_argmax_then_step_cuda(quant):
    """Captured graphs on the step kernels: a chain of step_after_argmax calls gives the tokens and
    the very logits of row_argmax followed by step([token]), across the 64-slot kv_len bucket's end
    and the sliding window's ring; rolled back at any point, the cache continues as the plain loop's."""
    from server.sampling import row_argmax
    from tests.test_fast_path import cuda_model

    model = cuda_model(torch.bfloat16, quant=quant)
    prompt = prompts_for(model.config.vocab_size, (40,))[0]
    plain_fast, chained_fast = (FastTarget(model, max_len=512, prefill_chunk=16, min_kv_len=64) for _ in range(2))
    assert chained_fast.chains_steps
    plain_logits = plain_fast.prefill(prompt)
    chained_logits = chained_fast.prefill(prompt)
    plain_tokens, chained_tokens = [], []
    for _ in range(70):
        token = row_argmax(plain_logits)[0]
        plain_logits = plain_fast.step([token])
        plain_tokens.append(token)
        token, chained_logits = chained_fast.step_after_argmax(chained_logits)
        chained_tokens.append(token)
        assert torch.equal(plain_logits, chained_logits), len(plain_tokens)
    assert chained_tokens == plain_tokens
    assert chained_fast.position == plain_fast.position == len(prompt) + 70
    for fast in (plain_fast, chained_fast):  # stop at the last token read: its step rolled back
        fast.rollback(1)
    assert torch.equal(plain_fast.step(plain_tokens[-1:] + [5, 6]), chained_fast.step(chained_tokens[-1:] + [5, 6]))


@needs_cuda
def test_engine_chains_plain_greedy_requests_cuda():
    """Whole requests through the engine on captured graphs: chained (the default for plain greedy
    requests there) against the same engine unchained, tokens, text, finish and counters alike,
    and the next turn's cached prefix."""
    from tests.test_fast_path import cuda_model

    class Unchained(FastTarget):
        chains_steps = False

    model = cuda_model(torch.bfloat16, quant=True)
    vocab = model.config.vocab_size
    prompt = prompts_for(vocab, (40,))[0]
    fasts = [cls(model, max_len=512, prefill_chunk=16, min_kv_len=64, prefix_budget_bytes=2**24)
             for cls in (FastTarget, Unchained)]
    calls = _counting(fasts[0])
    engines = [engine_for(model, IdTokenizer(), backend=fast) for fast in fasts]
    plain = run(engines[1], prompt, max_tokens=60, draft=False)[0]
    run(engines[0], prompt, max_tokens=60, draft=False)  # both caches in the same state
    for what, params in {"greedy": dict(max_tokens=60), "stop token": dict(max_tokens=60,
                                                                            stop_token_ids=frozenset({plain[20]})),
                         "stop string": dict(max_tokens=60, stop_strings=(f"<{plain[9]}><{plain[10]}>",)),
                         "max_tokens": dict(max_tokens=5)}.items():
        calls.clear()
        got = [run(engine, prompt, draft=False, **params) for engine in engines]
        _same(*got, what)
        assert calls, what
        turn = prompt + got[0][0][:5] + [7, 8]
        _same(*[run(engine, turn, max_tokens=8, draft=False) for engine in engines], (what, "next turn"))
