"""Sampled requests are drafted, losslessly: for the same seed, drafted output equals plain output
token for token, under every sampling setting, past the sliding window; and the draws are exact
samples of the processed distribution (a chi-square test). The random draw of output position i
depends only on (seed, i) (server.sampling), so how positions are grouped into forwards cannot
change a token.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from server.sampling import Sampler, SamplingParams
from tests.test_engine_lossless import (OracleWithErrors, PromptLookup, RandomDrafter, engine_for,  # noqa: F401
                                        gemma270m, one_thread, prompts_for, run, tiny, tiny_test)

PRESETS = [
    dict(temperature=0.7, top_p=0.8, top_k=20),        # an agent-benchmark client's preset
    dict(temperature=1.0, top_k=64, top_p=0.95),       # the Gemma team's recommendation
    dict(temperature=1.0),                             # OpenAI's default: the whole vocabulary
    dict(temperature=0.9, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
    dict(temperature=0.0, repetition_penalty=1.5),     # greedy with a penalty: drafted rows see the draft
]


@tiny_test
@pytest.mark.parametrize("preset", PRESETS, ids=[",".join(f"{k}={v}" for k, v in p.items()) for p in PRESETS])
def test_drafted_equals_plain_for_the_same_seed(tiny, preset):
    prompt = prompts_for(512, [40])[0]  # past the sliding window (8) from the first step
    engine = engine_for(tiny)
    accepted = 0
    for seed in (1, 2, 3):
        plain, *_ = run(engine, prompt, max_tokens=40, draft=False, seed=seed, **preset)
        for name, drafter in {"oracle": OracleWithErrors(len(prompt), plain, 512, 0.25, seed),
                              "random": RandomDrafter(512, seed), "lookup": PromptLookup()}.items():
            drafted_engine = engine_for(tiny, drafter=drafter)
            drafted, _, _, stats = run(drafted_engine, prompt, max_tokens=40, seed=seed, **preset)
            assert drafted == plain, (name, seed)
            if name == "oracle":
                assert stats.verify_steps > 0
                accepted += stats.accepted_tokens
    assert accepted > 0  # drafts were taken, not only offered


@tiny_test
def test_an_unseeded_request_samples_and_a_seed_repeats(tiny):
    prompt = prompts_for(512, [20])[0]
    engine = engine_for(tiny)
    a = run(engine, prompt, max_tokens=30, temperature=1.0, seed=11)[0]
    assert a == run(engine, prompt, max_tokens=30, temperature=1.0, seed=11)[0]
    unseeded = {tuple(run(engine, prompt, max_tokens=30, temperature=1.0)[0]) for _ in range(3)}
    assert len(unseeded) > 1


@tiny_test
def test_top_k_1_and_temperature_0_are_greedy(tiny):
    prompt = prompts_for(512, [20])[0]
    engine = engine_for(tiny)
    greedy = run(engine, prompt, max_tokens=30)[0]
    assert run(engine, prompt, max_tokens=30, temperature=1.3, top_k=1, seed=5)[0] == greedy
    assert run(engine, prompt, max_tokens=30, temperature=0.0, top_p=0.5, seed=5)[0] == greedy


def _processed_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The reference, written from the definitions: temperature, top_k, top_p, min_p, renormalized."""
    z = logits / p.temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), dtype=bool)
    keep[order[:p.top_k if p.top_k > 0 else len(z)]] = True
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        cum = np.cumsum(probs[order])
        cut = int(np.searchsorted(cum, p.top_p)) + 1
        mask = np.zeros(len(z), dtype=bool)
        mask[order[:cut]] = True
        probs = np.where(mask, probs, 0.0) / probs[order[:cut]].sum()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


# chi-square critical values at significance 0.001, by degrees of freedom
CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
                       10: 29.59, 11: 31.26}


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1),
                                    SamplingParams(temperature=1.0, seed=2),
                                    SamplingParams(temperature=1.3, min_p=0.1, seed=3),
                                    SamplingParams(temperature=0.8, top_p=0.7, seed=4)])
def test_draws_follow_the_processed_distribution(params):
    """Over 20,000 output positions (each its own keyed draw), the token frequencies match the
    reference distribution: chi-square below its 0.1 % critical value, and no token outside the
    support is ever drawn. Deterministic: the draws are keyed by (seed, position)."""
    logits = np.random.default_rng(0).normal(0.0, 1.5, 12).astype(np.float32)
    expected = _processed_distribution(logits.astype(np.float64), params)
    sampler = Sampler(params, [])
    n = 20_000
    counts = np.bincount([sampler.pick(torch.from_numpy(logits), i) for i in range(n)], minlength=12)
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    chi2 = float((((counts - n * expected) ** 2)[support] / (n * expected[support])).sum())
    assert chi2 < CHI2_CRITICAL_0_001[int(support.sum()) - 1], (chi2, counts, expected)


def test_penalties_follow_their_definitions():
    """repetition (prompt and output), frequency and presence (output only), before the argmax."""
    logits = torch.tensor([2.0, 1.9, -1.0, 1.0, 0.5])
    greedy_rep = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0])
    assert greedy_rep.pick(logits, 0) == 1            # token 0's 2.0 becomes 1.0
    freq = Sampler(SamplingParams(frequency_penalty=0.6, presence_penalty=0.0), prompt_ids=[1])
    assert freq.pick(logits, 0) == 0                  # the prompt does not count for frequency
    freq.commit(0)
    assert freq.pick(logits, 1) == 1                  # 2.0 - 0.6 < 1.9
    assert freq.pick(logits, 1, pending=[1, 1]) == 0  # pending draft tokens count as output: 1.9 - 1.2
    presence = Sampler(SamplingParams(presence_penalty=1.5), prompt_ids=[])
    presence.commit(0)
    presence.commit(1)
    assert presence.pick(logits, 2) == 3


@pytest.mark.slow
def test_270m_sampled_drafted_equals_plain(gemma270m):
    """The bundled model on the CPU int8 path (the default): prompts past its 512-token sliding
    window and short ones, both sampling presets of the issue plus penalties; drafts from the true
    continuation with errors injected and from prompt lookup."""
    from server.engine import Engine, EngineConfig
    from tests.test_engine_lossless import SNIPPETS, _long_prompts, drafters

    tok = gemma270m.tokenizer
    prompts = _long_prompts(tok) + [tok(t)["input_ids"] for t in SNIPPETS[:3]]
    engine = Engine(gemma270m, None, EngineConfig(adaptive=False))
    vocab = gemma270m.model.config.vocab_size
    presets = PRESETS[:2] + [PRESETS[3]]
    for i, prompt in enumerate(prompts):
        preset = presets[i % len(presets)]
        plain, *_ = run(engine, prompt, max_tokens=16, draft=False, seed=100 + i, **preset)
        for kind in ("oracle-err-0.2", "prompt-lookup", "tree-oracle-err-0.5"):
            engine.set_drafter(drafters(len(prompt), plain, vocab, i)[kind])
            got, _, _, stats = run(engine, prompt, max_tokens=16, seed=100 + i, **preset)
            assert got == plain, (i, kind, preset)
        engine.set_drafter(None)
    assert engine.totals()["accepted_tokens"] > 0
