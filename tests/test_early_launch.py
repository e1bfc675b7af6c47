"""Each step launched before the text before it is handed out (server/engine.py `launch_early`).

On the GPU fast path a step is a graph replay that returns at once, so the engine launches the next
step as soon as the last one's tokens are committed as tokens, and only then decodes their text,
checks stop strings and yields the chunk: the host's text work and the chunk's consumer overlap the
forward. A stop string found after the launch ends the request there; the launched step is rolled
back with the rest. Nothing a caller sees may change: these tests run the same requests with the
early launch forced on and off on CPU backends (whose steps run in the call, so the order is all
that differs) and compare the tokens, the text, the finish, the stop string, every counter, and the
backend's state afterwards (the prefix cache a next turn resumes from). Cases: greedy and seeded
sampling, chains and token trees, stop tokens, stop strings that end a step in its middle,
max_tokens, a grammar, the transformers, CPU int8 and fast-path (uncaptured) backends.
"""
from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from server.engine import RequestStats
from server.fast_path import FastTarget
from tests.test_engine_lossless import (IdTokenizer, OracleWithErrors, TreeOracle, engine_for, prompts_for, run,
                                        tiny_gemma4)

# Every counter but the chained steps, which say how a step was launched (what _same compares: a
# chained engine against an unchained one), not what it decoded
COUNTERS = [f.name for f in fields(RequestStats) if not f.name.endswith("_s") and f.name != "chained_steps"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma4(seed=3)


def _engines(model, backend_kind: str, drafter):
    """(early, late): the same engine twice, the early launch forced on and off; `drafter()` makes
    each its own drafter."""
    def make(early: bool):
        kwargs = {}
        if backend_kind == "fast":
            kwargs["backend"] = FastTarget(model, max_len=256, prefill_chunk=16, capture=False, min_kv_len=16,
                                           prefix_budget_bytes=2**24)
        elif backend_kind == "cpu_int8":
            kwargs.update(cpu_int8=True, parallel=1)
        return engine_for(model, IdTokenizer(), drafter=drafter(), launch_early=early, **kwargs)
    return make(True), make(False)


def _same(a, b, what):
    tokens_a, text_a, finish_a, stats_a = a
    tokens_b, text_b, finish_b, stats_b = b
    assert tokens_a == tokens_b, what
    assert text_a == text_b and finish_a == finish_b, what
    assert {c: getattr(stats_a, c) for c in COUNTERS} == {c: getattr(stats_b, c) for c in COUNTERS}, what


@pytest.mark.parametrize("backend_kind", ["fast", "cpu_int8", "eager"])
def test_early_and_late_launch_give_the_same_requests(tiny, backend_kind):
    vocab = tiny.config.vocab_size
    requests = {
        "greedy": lambda plain: dict(max_tokens=40),
        "sampled": lambda plain: dict(max_tokens=40, temperature=0.9, top_p=0.95, seed=5),
        "stop token": lambda plain: dict(max_tokens=40, stop_token_ids=frozenset({plain[17]})),
        # the text of tokens 9 and 10: a stop string that ends a drafted step in its middle
        "stop string": lambda plain: dict(max_tokens=40, stop_strings=(f"<{plain[9]}><{plain[10]}>",)),
        "max_tokens": lambda plain: dict(max_tokens=7),
    }
    kinds = ["plain", "oracle"] + (["tree"] if backend_kind == "fast" else [])  # trees: where verified in one step
    for seed, prompt in enumerate(prompts_for(vocab, (6, 30))):
        plain, *_ = run(engine_for(tiny, IdTokenizer()), prompt, max_tokens=40, draft=False)
        for kind in kinds:
            for what, params in requests.items():
                # fresh engines and drafters for each request: a test drafter draws random numbers,
                # and a step launched early and then rolled back (a stop string) drew some more
                drafter = {"plain": lambda: None,
                           "oracle": lambda: OracleWithErrors(len(prompt), plain, vocab, 0.3, seed),
                           "tree": lambda: TreeOracle(len(prompt), plain, vocab, 0.4, seed)}[kind]
                engines = _engines(tiny, backend_kind, drafter)
                got = [run(engine, prompt, **params(plain)) for engine in engines]
                _same(*got, (backend_kind, kind, what))
                if backend_kind != "eager":
                    # the state the request left: a next turn resumes from the same cached prefix
                    turn = prompt + got[0][0][:5] + [7, 8]
                    _same(*[run(engine, turn, max_tokens=5, draft=False) for engine in engines],
                          (backend_kind, kind, what, "next turn"))


def test_a_stop_string_after_an_early_launch_takes_back_the_tokens_after_it(tiny):
    """The step launched before the text showed the stop string is rolled back: the usage counts
    the tokens up to the one that completed it, the kept sequence ends there."""
    vocab = tiny.config.vocab_size
    prompt = prompts_for(vocab, (12,))[0]
    plain, *_ = run(engine_for(tiny, IdTokenizer()), prompt, max_tokens=30, draft=False)
    fast = FastTarget(tiny, max_len=256, prefill_chunk=16, capture=False, min_kv_len=16, prefix_budget_bytes=2**24)
    engine = engine_for(tiny, IdTokenizer(), drafter=OracleWithErrors(len(prompt), plain, vocab, 0.0), backend=fast,
                        launch_early=True)
    tokens, text, finish, stats = run(engine, prompt, max_tokens=30, stop_strings=(f"<{plain[6]}>",))
    assert finish == "stop" and tokens == plain[:7] and text == "".join(f"<{t}>" for t in plain[:6])
    assert stats.completion_tokens == 7 and stats.verify_steps > 0
    # kept: the prompt and the committed tokens but the last (pending); not the launched step's
    *_, stats = run(engine, prompt + plain[:7] + [7, 8], max_tokens=2, draft=False)
    assert stats.cached_tokens == len(prompt) + 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_early_launch_on_captured_graphs_cuda():
    """The fast path's captured steps (bf16, step kernels): the engine launches early by itself
    (async_steps), and every request equals the late-launch one."""
    from tests.test_fast_path import cuda_model

    model = cuda_model(torch.bfloat16, quant=True)
    vocab = model.config.vocab_size
    prompt = prompts_for(vocab, (40,))[0]
    late_fast, early_fast = (FastTarget(model, max_len=256, prefill_chunk=16, min_kv_len=64,
                                        prefix_budget_bytes=2**24) for _ in range(2))
    assert early_fast.async_steps and early_fast.step_kernels
    # the plain reference from each, so that both prefix caches start from the same state
    plain, early_plain = (run(engine_for(model, IdTokenizer(), backend=fast), prompt, max_tokens=40, draft=False)[0]
                          for fast in (late_fast, early_fast))
    assert early_plain == plain
    for what, params in {"greedy": dict(max_tokens=40), "sampled": dict(max_tokens=40, temperature=0.9, seed=5),
                         "stop string": dict(max_tokens=40, stop_strings=(f"<{plain[9]}><{plain[10]}>",))}.items():
        engines = [engine_for(model, IdTokenizer(), drafter=OracleWithErrors(len(prompt), plain, vocab, 0.3, 1),
                              backend=fast, launch_early=early) for fast, early in ((early_fast, None),
                                                                                   (late_fast, False))]
        _same(*[run(engine, prompt, **params) for engine in engines], what)
