"""Plain greedy steps chained on the device (server/fast_path.py `step_after_argmax`, server/engine.py
`_complete`): the next one-token step is launched from the argmax the step before left on the
GPU, before the host reads it, so the GPU does not wait for the host between steps.

Nothing a caller sees may change. On the CPU (CI) the engine's side runs on an uncaptured fast
path told that it chains (its `step_after_argmax` is then the plain sequence: argmax, then a
step), so the bookkeeping is what is tested: the same tokens, text, finish and counters as the
unchained engine, the launched step rolled back where a request ends (stop token, stop string,
max_tokens), and the same cached prefix for the next turn. Requests that must not chain (drafts,
sampling, penalties) do not. Drafting requests chain during droughts (`DROUGHT_STEPS` plain steps in
a row): the same output as with the rule off (drafters dry at some positions, right or wrong at
others, refused by the cost policy and probed), chained steps and then drafts verified again, the
drafter asked once a position, and requests ending inside a chained drought (stop token, stop
string, max_tokens) leaving the same cached prefix and finishing the session with their tokens;
sampled and grammar-constrained drafting requests never chain. On CUDA the device chain itself:
token for token and bit for bit the logits of `row_argmax` followed by `step`, and whole requests
through the engine."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import server.engine as engine_module
from ngram.draft import Draft
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
            assert got[0][3].chained_steps == chained and got[1][3].chained_steps == 0, what
            if what in ("sampled", "penalized", "drafted", "one token"):
                assert chained == 0, what
            else:  # every plain step, but not the one that makes the max_tokens-th token
                steps = got[0][3].plain_steps
                assert 0 < chained == (steps - 1 if got[0][2] == "length" else steps), (what, chained, steps)
            assert not calls[1]
            # the state the request left: a next turn resumes from the same cached prefix
            turn = prompt + got[0][0][:5] + [7, 8]
            _same(*[run(engine, turn, max_tokens=5, draft=False) for engine in engines], (what, "next turn"))


# ---------------------------------------------------------------- drafting requests, chained in droughts

class _Droughts:
    """A drafter whose output position p (context = prompt + p tokens, the last one pending) gets
    `kind(p)`: "dry" an empty draft, "right" the true continuation, "wrong" it with its first token
    wrong (rejected), at most `longest` tokens each, with `confidence` (low: the cost policy refuses
    them, and probes). Its sessions log to `events` ("v": a verified draft, fed back) and keep the
    context lengths they were asked at and the context `finish` got."""

    def __init__(self, prompt_len: int, reference: list[int], kind, vocab: int, events: list,
                 longest: int = 4, confidence: float = 1.0):
        self.prompt_len, self.reference, self.kind, self.vocab = prompt_len, reference, kind, vocab
        self.events, self.longest, self.confidence = events, longest, confidence
        self.sessions = []

    def session(self):
        self.sessions.append(_DroughtSession(self))
        return self.sessions[-1]


class _DroughtSession:
    def __init__(self, drafter: _Droughts):
        self.drafter, self.asked, self.finished = drafter, [], None

    def prepare(self, context_ids) -> None:
        pass

    def propose(self, context_ids, max_tokens: int) -> Draft:
        d = self.drafter
        self.asked.append(len(context_ids))
        p = len(context_ids) - d.prompt_len
        kind = d.kind(p)
        tokens = [] if kind == "dry" else list(d.reference[p:p + min(max_tokens, d.longest)])
        if kind == "wrong" and tokens:
            tokens[0] = (tokens[0] + 1) % d.vocab
        return Draft(np.asarray(tokens, dtype=np.int32), np.full(len(tokens), d.confidence, dtype=np.float32),
                     "droughts", 0)

    def feedback(self, drafted: int, accepted: int) -> None:
        assert 0 <= accepted <= drafted
        self.drafter.events.append("v")

    def finish(self, context_ids=None) -> None:
        assert self.finished is None
        self.finished = [int(t) for t in context_ids]


def _drought_run(steps, engine, prompt, **params):
    """`run` with DROUGHT_STEPS set to `steps` (None: the rule off)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "DROUGHT_STEPS", steps)
        return run(engine, prompt, **params)


def _logged(fast: FastTarget, events: list) -> FastTarget:
    """Log `fast`'s step_after_argmax calls to `events` ("c")."""
    inner = fast.step_after_argmax

    def logged(logits):
        events.append("c")
        return inner(logits)
    fast.step_after_argmax = logged
    return fast


def _drought_engines(model, drafters, **config):
    """One engine per drafter, each on its own target that says it chains."""
    return [engine_for(model, IdTokenizer(), launch_early=True, drafter=drafter,
                       backend=_logged(_SaysItChains(model, max_len=256, prefill_chunk=16, capture=False,
                                                     min_kv_len=16, prefix_budget_bytes=2**24), drafter.events),
                       **config)
            for drafter in drafters]


def _runs(events: list) -> str:
    """The events with each run of one kind written once ("cccvvc" -> "cvc")."""
    return "".join(e for i, e in enumerate(events) if i == 0 or events[i - 1] != e)


# kinds of drafts by output position: droughts of 12-24 steps between stretches of drafts
DRY_THEN_DRAFTS = {
    "right": lambda p: "dry" if p < 20 or 28 <= p < 52 else "right",
    "wrong": lambda p: "dry" if p < 20 or 28 <= p < 52 else ("wrong" if p % 3 == 0 else "right"),
}


@pytest.mark.parametrize("steps", [8, 1])
def test_drafting_requests_chain_in_droughts_and_draft_after(tiny, steps):
    vocab = tiny.config.vocab_size
    for seed, prompt in enumerate(prompts_for(vocab, (6, 30))):
        plain, *_ = run(engine_for(tiny, IdTokenizer()), prompt, max_tokens=80, draft=False)
        for what, kind in DRY_THEN_DRAFTS.items():
            drafters = [_Droughts(len(prompt), plain, kind, vocab, []) for _ in range(2)]
            on, off = _drought_engines(tiny, drafters)
            got = _drought_run(steps, on, prompt, max_tokens=80)
            want = _drought_run(None, off, prompt, max_tokens=80)
            assert got[:3] == want[:3] and got[0] == plain, (what, seed)
            assert got[3].completion_tokens == want[3].completion_tokens
            # chained in both droughts, and drafts verified after each
            assert "cvcv" in _runs(drafters[0].events), (what, seed, drafters[0].events)
            assert got[3].verify_steps > 0 and "c" not in drafters[1].events
            assert got[3].chained_steps == drafters[0].events.count("c") and want[3].chained_steps == 0
            for drafter in drafters:  # each position asked once, and the session finished with the output
                session, = drafter.sessions
                assert session.asked == sorted(set(session.asked)), (what, seed)
                assert session.finished == prompt + got[0]


def test_droughts_of_refused_drafts_chain_and_still_probe(tiny):
    """The adaptive policy refuses drafts of low confidence (a refused draft is a plain step, as an
    empty one is) and probes them after PROBE_INTERVAL refusals; wrong drafts make the probes fail,
    the interval grows and the refusals run into long droughts, chained. A probe chosen at a chained
    step is not run there (that step is plain) but stays due: probes still run, and the output is
    the rule-off output."""
    vocab = tiny.config.vocab_size
    cost = np.array([0.0, 1.0, 1.3, 1.6, 1.9, 2.2, 2.5])

    def kind(p):
        return "dry" if p < 12 else ("right" if 60 <= p < 66 else "wrong")
    for seed, prompt in enumerate(prompts_for(vocab, (6, 30))):
        plain, *_ = run(engine_for(tiny, IdTokenizer()), prompt, max_tokens=120, draft=False)
        drafters = [_Droughts(len(prompt), plain, kind, vocab, [], confidence=0.1) for _ in range(2)]
        on, off = _drought_engines(tiny, drafters, adaptive=True, cost_curve=cost)
        got = _drought_run(8, on, prompt, max_tokens=120)
        want = _drought_run(None, off, prompt, max_tokens=120)
        assert got[:3] == want[:3] and got[0] == plain, seed
        assert got[3].probes > 0 and want[3].probes > 0, seed
        assert "cvc" in _runs(drafters[0].events), (seed, drafters[0].events)
        for drafter in drafters:
            session, = drafter.sessions
            assert session.asked == sorted(set(session.asked)), seed


def test_sampled_and_constrained_drafting_requests_never_chain(tiny):
    from tests.test_constrained import BYTE_TOKENIZER, byte_compiler

    vocab = tiny.config.vocab_size
    prompt = prompts_for(vocab, (12,))[0]
    never = [dict(temperature=0.9, seed=5), dict(repetition_penalty=1.3),
             dict(constraint=byte_compiler(False).json_object()),
             dict(constraint=byte_compiler(False).json_object(), temperature=0.8, seed=3)]
    for params in never:
        events = []
        tokenizer = BYTE_TOKENIZER if "constraint" in params else IdTokenizer()
        fast = _logged(_SaysItChains(tiny, max_len=256, prefill_chunk=16, capture=False, min_kv_len=16,
                                     prefix_budget_bytes=2**24), events)
        dry = _Droughts(len(prompt), [], lambda p: "dry", vocab, events)
        engine = engine_for(tiny, tokenizer, launch_early=True, drafter=dry, backend=fast)
        *_, stats = _drought_run(1, engine, prompt, max_tokens=40, **params)
        assert stats.plain_steps > 8 and not events, params


@pytest.mark.parametrize("drafts", ["dry", "droughts"])
def test_drafting_requests_ending_in_a_chained_drought(tiny, drafts):
    """Stop token, stop string and max_tokens inside a chained drought: the same output as with the
    rule off (every counter too where the drafter is always dry), the step launched after the last
    token rolled back (the next turn resumes from the same cached prefix), and the session finished
    with the request's committed tokens."""
    vocab = tiny.config.vocab_size
    kind = (lambda p: "dry") if drafts == "dry" else (lambda p: "right" if 12 <= p < 16 else "dry")
    requests = {
        "stop token": lambda plain: dict(max_tokens=60, stop_token_ids=frozenset({plain[40]})),
        "stop string": lambda plain: dict(max_tokens=60, stop_strings=(f"<{plain[33]}><{plain[34]}>",)),
        "max_tokens": lambda plain: dict(max_tokens=37),
    }
    for seed, prompt in enumerate(prompts_for(vocab, (6, 30))):
        plain, *_ = run(engine_for(tiny, IdTokenizer()), prompt, max_tokens=60, draft=False)
        for what, params in requests.items():
            drafters = [_Droughts(len(prompt), plain, kind, vocab, []) for _ in range(2)]
            on, off = _drought_engines(tiny, drafters)
            got = _drought_run(8, on, prompt, **params(plain))
            want = _drought_run(None, off, prompt, **params(plain))
            if drafts == "dry":
                _same(got, want, (what, seed))
            else:
                assert got[:3] == want[:3], (what, seed)
            assert drafters[0].events[-1:] == ["c"], (what, seed)  # the request ended while chaining
            stop = [plain[len(got[0])]] if what == "stop token" else []
            for drafter in drafters:
                assert drafter.sessions[0].finished == prompt + got[0] + stop, (what, seed)
            turn = prompt + got[0][:5] + [7, 8]
            _same(*[run(engine, turn, max_tokens=5, draft=False) for engine in (on, off)], (what, seed, "next turn"))


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


@needs_cuda
def test_engine_chains_droughts_of_drafting_requests_cuda():
    """The drought rule on captured graphs: drafting requests whose drafter is dry for stretches
    (chained plain steps) between drafts verified in multi-token steps, with and without the rule,
    against plain decoding; stop tokens and max_tokens inside a chained stretch; the next turn."""
    from tests.test_fast_path import cuda_model

    model = cuda_model(torch.bfloat16, quant=True)
    vocab = model.config.vocab_size
    prompt = prompts_for(vocab, (40,))[0]
    plain_engine = engine_for(model, IdTokenizer(), backend=FastTarget(model, max_len=512, prefill_chunk=16,
                                                                       min_kv_len=64, prefix_budget_bytes=2**24))
    plain = run(plain_engine, prompt, max_tokens=80, draft=False)[0]
    for what, kind in DRY_THEN_DRAFTS.items():
        drafters = [_Droughts(len(prompt), plain, kind, vocab, []) for _ in range(2)]
        on, off = [engine_for(model, IdTokenizer(), drafter=drafter,
                              backend=_logged(FastTarget(model, max_len=512, prefill_chunk=16, min_kv_len=64,
                                                         prefix_budget_bytes=2**24), drafter.events))
                   for drafter in drafters]
        got = _drought_run(8, on, prompt, max_tokens=80)
        want = _drought_run(None, off, prompt, max_tokens=80)
        assert got[:3] == want[:3] and got[0] == plain, what
        assert "cvcv" in _runs(drafters[0].events) and got[3].chained_steps > 0 and want[3].chained_steps == 0
        for ending, params in {"stop token": dict(max_tokens=80, stop_token_ids=frozenset({plain[60]})),
                               "max_tokens": dict(max_tokens=63)}.items():
            ends = [_drought_run(steps, engine, prompt, **params) for steps, engine in ((8, on), (None, off))]
            assert ends[0][:3] == ends[1][:3] and ends[0][0] == plain[:len(ends[0][0])], (what, ending)
            turn = prompt + ends[0][0][:5] + [7, 8]
            assert run(on, turn, max_tokens=8, draft=False)[:3] == run(off, turn, max_tokens=8, draft=False)[:3]
