"""Hostile input never becomes a 5xx: bench/fuzz.py's seeded probes against the real server
(the bundled model, in-process on a real port). A few hundred probes here; `make fuzz` sends 10,000."""
from __future__ import annotations

import httpx
import pytest

from bench.fuzz import hostile_requests, run_fuzz
from ngram.drafter import NgramDrafter
from bench.live_server import ServerThread
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.serving import Service
from server.settings import Settings


def test_every_category_is_generated():
    kinds = {p.kind for p, _ in zip(hostile_requests(0), range(400))}
    assert kinds == {"malformed_json", "wrong_types", "deep_nesting", "huge_values", "odd_paths", "token_ids",
                     "oversized", "disconnect", "valid"}


@pytest.mark.slow
def test_fuzz_the_real_server():
    from server.model_loading import load_target

    target = load_target(None)
    engine = Engine(target, NgramDrafter(None), EngineConfig(adaptive=False, max_context=2048))
    service = Service(engine, Settings(trace_log=False, default_max_tokens=4))
    with ServerThread(create_app(service)) as url:
        report = run_fuzz(url, 200, seed=1)
        metrics = httpx.get(url + "/metrics").text
    assert not report.server_errors, report.server_errors[:5]
    assert not report.hangs, report.hangs[:5]
    assert report.served_after
    assert "sailfish_internal_errors_total 0" in metrics
    # every category reached the server and got an answer
    assert report.by_kind["token_ids"] and report.by_kind["deep_nesting"] and report.by_kind["valid"].get(200)
