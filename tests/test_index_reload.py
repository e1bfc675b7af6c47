"""Hot reload under load (issue 7): requests streaming during ten index reloads all complete with
output identical to a run without reloads; a rebuilt index with another tokenizer's fingerprint is
refused (409) and the index in service stays."""
from __future__ import annotations

import threading

import numpy as np
import openai
import pytest

from common.tokenizer import tokenizer_fingerprint
from ngram.index_file import BuildParams, write_index
from bench.live_server import ServerThread
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.serving import Service
from server.settings import Settings

pytestmark = pytest.mark.slow
PROMPTS = ["Count: one, two, three, four, five,", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown"]


@pytest.fixture(scope="module")
def target():
    from server.model_loading import load_target

    return load_target(None)


def _index_generation(directory, fingerprint, seed):
    rng = np.random.default_rng(seed)
    turns = [rng.integers(100, 5000, size=40).astype(np.uint32) for _ in range(20)]
    write_index(directory, turns, fingerprint, BuildParams())


def _stream_all(client, results):
    for i, prompt in enumerate(PROMPTS * 2):
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt=prompt, max_tokens=20, stream=True) if c.choices)
        results.append(text)


def test_reloads_under_load_change_no_output(target, tmp_path):
    fingerprint = tokenizer_fingerprint(target.tokenizer)
    index_dir = tmp_path / "index"
    _index_generation(index_dir, fingerprint, 0)
    settings = Settings(index=index_dir, trace_log=False, watch_index=0, api_key="k")
    from ngram.index_file import load_index
    from ngram.drafter import NgramDrafter

    drafter = NgramDrafter(load_index(index_dir, fingerprint), settings.drafter)
    engine = Engine(target, drafter, EngineConfig(cost_curve=np.ones(17)))
    service = Service(engine, settings)
    with ServerThread(create_app(service)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        alone: list[str] = []
        _stream_all(client, alone)

        during: list[str] = []
        worker = threading.Thread(target=_stream_all, args=(client, during))
        worker.start()
        admin = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        statuses = []
        for i in range(10):
            _index_generation(index_dir, fingerprint, i + 1)
            statuses.append(admin.post("/admin/reload-index", cast_to=dict, body={})["reloaded"])
        worker.join()
        assert statuses == [True] * 10
        assert during == alone

        # another tokenizer's index is refused; the one in service stays
        in_service = engine._drafter.index.path
        _index_generation(index_dir, "another-tokenizer", 99)
        with pytest.raises(openai.APIStatusError) as refused:
            admin.post("/admin/reload-index", cast_to=dict, body={})
        assert refused.value.status_code == 409 and "different tokenizer" in str(refused.value)
        assert engine._drafter.index.path == in_service
        # the admin endpoint is guarded like the API
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).post("/admin/reload-index", cast_to=dict, body={})


def test_the_watcher_reloads_and_health_says_so_and_a_refused_generation_is_read_once(target, tmp_path,
                                                                                       monkeypatch):
    """No index at start (the README's own flow: serve, then `make index`): the watcher puts the
    built one in service and /health's "drafting" says so; a broken generation published after it
    is refused once, not re-read every poll, and the one in service stays."""
    import time

    import httpx

    import server.reload
    from ngram.drafter import NgramDrafter

    fingerprint = tokenizer_fingerprint(target.tokenizer)
    index_dir = tmp_path / "index"
    settings = Settings(index=index_dir, trace_log=False)
    engine = Engine(target, NgramDrafter(None, settings.drafter), EngineConfig(cost_curve=np.ones(17)))
    service = Service(engine, settings, "no usable index: drafting from the live context")
    loads = []
    real_load = server.reload.load_index
    monkeypatch.setattr(server.reload, "load_index", lambda *a: loads.append(a[0]) or real_load(*a))
    service.reloader.watch(0.05)
    try:
        with ServerThread(create_app(service)) as url:
            assert "no usable index" in httpx.get(url + "/health").json()["drafting"]
            _index_generation(index_dir, fingerprint, 1)
            for _ in range(200):
                if service.reloader.in_service() is not None:
                    break
                time.sleep(0.05)
            health = httpx.get(url + "/health").json()
            assert health["index"] == str(service.reloader.in_service())
            assert health["drafting"].startswith(f"index {service.reloader.in_service().name} in service")
            good = service.reloader.in_service()
            _index_generation(index_dir, "another-tokenizer", 2)
            time.sleep(0.6)  # a dozen polls
            assert service.reloader.in_service() == good and len(loads) == 2  # the good one, the bad one once
    finally:
        service.reloader.stop()


def test_the_watcher_outlives_a_generation_that_breaks_the_reload(target, tmp_path, monkeypatch):
    """An unexpected exception while putting a generation in service (here make_drafter's) is logged
    and that generation is not read again; the watcher thread lives on (it died, so no later build
    was picked up until a manual reload) and the next good generation goes into service."""
    import time

    import server.reload
    from ngram.drafter import NgramDrafter

    fingerprint = tokenizer_fingerprint(target.tokenizer)
    index_dir = tmp_path / "index"
    settings = Settings(index=index_dir, trace_log=False)
    engine = Engine(target, NgramDrafter(None, settings.drafter), EngineConfig(cost_curve=np.ones(17)))
    service = Service(engine, settings, "no usable index: drafting from the live context")
    real_make = server.reload.make_drafter
    calls = []

    def make_drafter(index, *args):
        calls.append(index.path)
        if len(calls) == 1:
            raise RuntimeError("a reader this generation breaks")
        return real_make(index, *args)
    monkeypatch.setattr(server.reload, "make_drafter", make_drafter)

    def wait_for(done):
        for _ in range(200):
            if done():
                return True
            time.sleep(0.05)
        return False

    service.reloader.watch(0.05)
    try:
        _index_generation(index_dir, fingerprint, 1)
        assert wait_for(lambda: calls)
        time.sleep(0.4)   # several polls: the broken generation is not read again
        assert len(calls) == 1 and service.reloader.in_service() is None
        _index_generation(index_dir, fingerprint, 2)
        assert wait_for(lambda: service.reloader.in_service() is not None)
        assert len(calls) == 2 and service.reloader.in_service() == calls[1]
    finally:
        service.reloader.stop()
