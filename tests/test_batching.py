"""Several requests at once (server/batcher.py, the engine's lanes, the scheduler's workers): every
request's output equals its output served alone, at 1, 2, 4 and 8 concurrent streams, greedy and
seeded sampling, drafted (chains and token trees) and plain, with the prefix cache on, and with nothing
cached (prefill chunks beside the others' drafted steps); their steps
really share forwards; cancelling one disturbs no other; a full queue answers 429 with Retry-After
in each API's error shape while the server keeps serving."""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import openai
import pytest

from server.cpu_backend import CpuBackend
from server.cpu_model import CpuGemma
from tests.test_cpu_model import tiny_gemma3
from tests.test_engine_lossless import (OracleWithErrors, PromptLookup, RandomDrafter, TreeOracle, engine_for,
                                        first_divergence, prompts_for, run)


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3(seed=3)


def _requests(n_requests: int):
    """(prompt, generation kwargs, drafter factory given the solo output) for each request."""
    prompts = prompts_for(512, [5, 12, 40, 9, 30, 17, 3, 25], seed=31)
    samplings = [{}, dict(temperature=1.0, top_k=64, top_p=0.95, seed=7), dict(temperature=0.7, seed=11),
                 dict(temperature=0.9, repetition_penalty=1.3, seed=5)]
    drafters = [lambda p, ref: OracleWithErrors(len(p), ref, 512, 0.3, seed=1),
                lambda p, ref: TreeOracle(len(p), ref, 512, 0.4, seed=2),
                lambda p, ref: RandomDrafter(512, seed=3), lambda p, ref: PromptLookup(), None]
    return [(prompts[i % len(prompts)], samplings[i % len(samplings)], drafters[i % len(drafters)])
            for i in range(n_requests)]


def _concurrently(engine, jobs) -> list:
    """Run engine.generate for every (prompt, kwargs) at once, one thread each; their `run` results
    (tokens, text, finish reason, stats)."""
    out: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def go(i, prompt, kw):
        start.wait()
        out[i] = run(engine, prompt, **kw)

    threads = [threading.Thread(target=go, args=(i, p, kw)) for i, (p, kw) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


class _PerRequestDrafter:
    """The drafter of the request whose prompt a session serves (each request drafts its own way)."""

    def __init__(self, by_prompt: dict):
        self.by_prompt = by_prompt

    def session(self):
        return _DispatchSession(self.by_prompt)


class _DispatchSession:
    def __init__(self, by_prompt):
        self.by_prompt, self.inner = by_prompt, None

    def prepare(self, context_ids) -> None:
        drafter = self.by_prompt.get(tuple(int(t) for t in context_ids))
        self.inner = drafter.session() if drafter is not None else None

    def propose(self, context_ids, max_tokens):
        from ngram.draft import EMPTY_DRAFT

        return self.inner.propose(context_ids, max_tokens) if self.inner is not None else EMPTY_DRAFT

    def feedback(self, drafted, accepted) -> None:
        if self.inner is not None:
            self.inner.feedback(drafted, accepted)

    def finish(self, context_ids=None) -> None:
        pass


@pytest.mark.parametrize("streams", [1, 2, 4, 8])
def test_concurrent_streams_equal_solo_runs(model, streams):
    cpu = CpuGemma.from_hf(model)
    engine = engine_for(model, backend=CpuBackend(cpu, 4096, 64 * 2**20, max_step=17), parallel=streams)
    assert engine.parallel == streams
    requests = _requests(streams)
    # Solo: each request alone, plain (its reference) and drafted its own way.
    by_prompt, jobs, solo = {}, [], []
    for prompt, kw, make in requests:
        reference, *_ = run(engine, prompt, max_tokens=32, draft=False, **kw)
        if make is not None:
            by_prompt[tuple(prompt)] = make(prompt, reference)
        solo.append(reference)
        jobs.append((prompt, dict(max_tokens=32, draft=make is not None, **kw)))
    engine.set_drafter(_PerRequestDrafter(by_prompt))
    before = engine.batch_summary() or {"forwards": 0, "sequences": 0}
    got = [tokens for tokens, *_ in _concurrently(engine, jobs)]
    for i, (tokens, reference) in enumerate(zip(got, solo)):
        assert tokens == reference, (i, requests[i][1], first_divergence(tokens, reference))
    if streams > 1:
        after = engine.batch_summary()
        assert after["peak_sequences"] > 1  # steps of different requests did share forwards
        assert after["sequences"] - before["sequences"] > after["forwards"] - before["forwards"]


@pytest.mark.parametrize("streams", [3, 6])
def test_concurrent_fresh_prompts_equal_solo_runs(model, streams):
    """Nothing cached: every request's prompt (64 to 600 tokens, past the window of 8) is computed
    while the others run, its prefill chunks in the same forwards as their drafted steps and trees.
    Each output equals the request's plain output served alone by another engine (greedy and seeded
    sampling), and each request really drafted and had drafts accepted."""
    cpu = CpuGemma.from_hf(model)
    alone = engine_for(model, backend=CpuBackend(cpu, 4096, 0, max_step=17), parallel=1)
    prompts = prompts_for(512, [300, 600, 129, 64, 410, 95][:streams], seed=57)
    samplings = [{}, dict(temperature=1.0, top_k=64, top_p=0.95, seed=7), dict(temperature=0.8, seed=13)]
    solo = [run(alone, p, max_tokens=24, draft=False, **samplings[i % 3])[0] for i, p in enumerate(prompts)]
    by_prompt = {tuple(p): (OracleWithErrors(len(p), ref, 512, 0.3, seed=i) if i % 2 == 0
                            else TreeOracle(len(p), ref, 512, 0.4, seed=i))
                 for i, (p, ref) in enumerate(zip(prompts, solo))}
    engine = engine_for(model, backend=CpuBackend(cpu, 4096, 0, max_step=17), parallel=streams)
    engine.set_drafter(_PerRequestDrafter(by_prompt))
    forwards: list = []
    real_forward = cpu.forward_batch

    def recording_forward(batch):
        forwards.append([(len(rows.ids), rows.last_only) for rows in batch])
        return real_forward(batch)

    cpu.forward_batch = recording_forward  # the lanes share this model object
    try:
        got = _concurrently(engine, [(p, dict(max_tokens=24, draft=True, **samplings[i % 3]))
                                     for i, p in enumerate(prompts)])
    finally:
        del cpu.forward_batch
    for i, ((tokens, _, _, stats), reference) in enumerate(zip(got, solo)):
        assert tokens == reference, (i, first_divergence(tokens, reference))
        assert stats.cached_tokens == 0 and stats.accepted_tokens > 0, (i, stats)
    # prefill chunks (only their last row's logits wanted) rode in forwards beside other requests' steps
    assert any(any(last for _, last in f) and any(not last for _, last in f) for f in forwards)
    assert max(len(f) for f in forwards) == streams


def test_concurrent_requests_sharing_a_kept_conversation_equal_fresh_runs(model):
    """Kept conversations in the store that every lane shares; at once: one's next turn (it takes the
    kept cache over), a prompt that leaves it mid-way (a copy of its prefix, when it comes before the
    take-over), a retry of the other kept one, and a stranger. Each output equals the same prompt
    computed afresh, alone and plain; the ones that share a kept prefix really reused it. Several
    rounds, so arrival orders vary."""
    cpu = CpuGemma.from_hf(model)
    fresh = engine_for(model, backend=CpuBackend(cpu, 4096, 0, max_step=17), parallel=1)
    for round_ in range(3):
        engine = engine_for(model, backend=CpuBackend(cpu, 4096, 64 * 2**20, max_step=17), parallel=4)
        a, b = prompts_for(512, [150, 90], seed=60 + round_)
        a_reply, *_ = run(engine, a, max_tokens=12, draft=False)
        run(engine, b, max_tokens=12, draft=False)
        next_turn = a + a_reply + prompts_for(512, [20], seed=70 + round_)[0][1:]
        leaves_mid_way = a[:100] + prompts_for(512, [40], seed=80 + round_)[0][1:]
        stranger = prompts_for(512, [120], seed=90 + round_)[0]
        prompts = [next_turn, leaves_mid_way, b, stranger]
        want = [run(fresh, p, max_tokens=16, draft=False)[0] for p in prompts]
        got = _concurrently(engine, [(p, dict(max_tokens=16, draft=False)) for p in prompts])
        for i, ((tokens, _, _, stats), reference) in enumerate(zip(got, want)):
            assert tokens == reference, (round_, i, first_divergence(tokens, reference))
        cached = [stats.cached_tokens for _, _, _, stats in got]
        # the next turn always takes A over; the copy finds A only if it came first (else the shared <bos>)
        assert cached[0] == len(a) + len(a_reply) - 1 and cached[1] in (100, 0, 1) and cached[2] == len(b) - 1
        assert cached[3] <= 1


def test_requests_at_once_on_transformers_path_queue_and_equal_solo_runs(model):
    """transformers' eager path serves one request at a time: several sent at once wait for the
    engine's one lane (its LanePool) and each output, drafted and sampled with a seed, equals its
    plain output alone."""
    engine = engine_for(model, prefix_cache_mb=64)
    assert engine.parallel == 1
    prompts = prompts_for(512, [40, 90, 17], seed=71)
    samplings = [{}, dict(temperature=0.8, seed=3), dict(temperature=1.0, top_k=50, seed=9)]
    solo = [run(engine, p, max_tokens=16, draft=False, **s)[0] for p, s in zip(prompts, samplings)]
    engine.set_drafter(_PerRequestDrafter({tuple(p): OracleWithErrors(len(p), ref, 512, 0.3, seed=i)
                                           for i, (p, ref) in enumerate(zip(prompts, solo))}))
    got = _concurrently(engine, [(p, dict(max_tokens=16, **s)) for p, s in zip(prompts, samplings)])
    for i, ((tokens, _, _, stats), reference) in enumerate(zip(got, solo)):
        assert tokens == reference, (i, first_divergence(tokens, reference))
        assert stats.accepted_tokens > 0


def test_cancelling_one_request_disturbs_no_other(model):
    cpu = CpuGemma.from_hf(model)
    engine = engine_for(model, backend=CpuBackend(cpu, 4096, 0, max_step=17), parallel=4)
    prompts = prompts_for(512, [7, 15, 22], seed=41)
    solo = [run(engine, p, max_tokens=40, draft=False)[0] for p in prompts]
    cancel = threading.Event()
    got: dict = {}

    def victim():
        from server.engine import GenerationParams

        for n, _ in enumerate(engine.generate(prompts_for(512, [11], seed=42)[0], GenerationParams(max_tokens=200),
                                              cancelled=cancel.is_set)):
            if n == 5:
                cancel.set()
        got["victim"] = True

    def other(i):
        got[i] = run(engine, prompts[i], max_tokens=40, draft=False)[0]

    threads = [threading.Thread(target=victim)] + [threading.Thread(target=other, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got["victim"] and [got[i] for i in range(3)] == solo
    assert engine.batch_summary()["members"] == 0  # every lane left the batcher


def test_a_full_queue_answers_429_with_retry_after_and_keeps_serving():
    from tests.test_server_protocol import ScriptedEngine, _serve

    engine = ScriptedEngine(delay=0.05)  # one request at a time, each about a second
    service, thread = _serve(engine, max_waiting=1)
    with thread as url:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        results: list = []

        def ask():
            results.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=60))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) == 2 and codes.count(429) == 2, codes  # one running, one waiting
        refused = next(r for r in results if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        messages = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        held = [threading.Thread(target=ask) for _ in range(2)]
        for t in held:
            t.start()
            time.sleep(0.05)
        r = httpx.post(url + "/v1/messages", json=messages, timeout=60)
        for t in held:
            t.join()
        assert r.status_code == 429 and r.json()["type"] == "error" and "retry-after" in r.headers
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert client.chat.completions.create(**body).choices[0].message.content  # still serving
        health = httpx.get(url + "/health").json()
        assert health["waiting"] == 0 and health["running"] == 0 and health["parallel"] == 1
        assert 'sailfish_requests_total{endpoint="chat",outcome="rejected"}' in httpx.get(url + "/metrics").text


def test_idle_lanes_take_a_burst_and_a_waiting_client_that_leaves_frees_its_place():
    """Requests sent at once to idle lanes are not refused as waiting (with --max-waiting 0 every
    request was), and a waiting request whose client disconnects frees its place at once instead of
    holding it (and inflating Retry-After) until a lane came free."""
    from tests.test_server_protocol import ScriptedEngine, _serve

    engine = ScriptedEngine(delay=0.05)   # each request about a second
    engine.parallel = 2
    service, thread = _serve(engine, max_waiting=0)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with thread as url:
        results: list = []

        def ask():
            results.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code)

        burst = [threading.Thread(target=ask) for _ in range(3)]
        for t in burst:
            t.start()
        for t in burst:
            t.join()
        assert sorted(results) == [200, 200, 429], results   # both lanes served, the third refused
    engine = ScriptedEngine(delay=0.05)
    service, thread = _serve(engine, max_waiting=1)
    with thread as url:
        running = threading.Thread(target=ask)
        running.start()
        while service.scheduler.running < 1:
            time.sleep(0.01)
        with pytest.raises(httpx.ReadTimeout):   # waits behind it, then its client gives up
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.3)
        deadline = time.time() + 5
        while service.scheduler.waiting and time.time() < deadline:
            time.sleep(0.01)
        assert service.scheduler.waiting == 0 and service.scheduler.running == 1
        late = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)   # its place is free
        running.join()
        assert late.status_code == 200, late.text
        health = httpx.get(url + "/health").json()
        assert health["waiting"] == 0 and health["running"] == 0


def test_rows_waiting_for_a_running_forward_sleep_until_it_ends():
    """Rows that arrive while a forward runs, and whose linger runs out before it ends, sleep until
    its end wakes them (server/batcher.py `_wait_s`); they used to look again every 0.1 ms, taking
    the GIL from the thread that ran the forward. Their forward runs right after, with them in it."""
    from server.batcher import StepBatcher

    class Rows:
        def __init__(self, value):
            self.value, self.ids = value, np.array([value])

    class SlowModel:
        def __init__(self):
            self.batches = []

        def forward_batch(self, rows):
            self.batches.append(list(rows))
            time.sleep(0.2 if len(self.batches) == 1 else 0.0)
            return [np.full(1, r.value) for r in rows]

    batcher = StepBatcher(SlowModel(), linger_s=0.005)
    looks = []
    wait = batcher._cv.wait
    batcher._cv.wait = lambda timeout=None: (looks.append(time.perf_counter()), wait(timeout))[1]
    batcher.join()
    batcher.join()
    first = threading.Thread(target=batcher.run, args=(Rows(1),))
    first.start()  # alone: its linger runs out and its 0.2 s forward starts
    time.sleep(0.05)
    started = time.perf_counter()
    looks.clear()
    logits, others = batcher.run(Rows(2))  # arrives mid-forward; linger over long before its end
    first.join()
    assert logits.tolist() == [2] and others == (0, 0)
    assert [len(b) for b in batcher.model.batches] == [1, 1]
    assert time.perf_counter() - started > 0.1   # it did wait for the running forward
    assert len(looks) <= 5, f"{len(looks)} looks while one forward ran"
