"""The verify cost curve: measured robustly (interleaved rounds, medians, a non-decreasing fit),
sensible under an artificial load, and kept on disk so that a restart does not measure again."""
from __future__ import annotations

import threading

import numpy as np
import torch

from server.backend import monotone_fit
from server.cost_cache import CostCurveCache
from server.cost_model import MARGIN
from tests.test_engine_lossless import engine_for, tiny_gemma4


def test_monotone_fit_pools_violators():
    fit = monotone_fit([1.0, 4.8, 1.2, 1.3, 0.74, 2.0])
    assert all(a <= b + 1e-12 for a, b in zip(fit, fit[1:]))
    assert monotone_fit([1, 2, 3]) == [1, 2, 3]
    assert monotone_fit([3, 1]) == [2, 2]


def _busy(stop: threading.Event) -> None:
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def test_curve_under_load_is_monotone_and_still_drafts():
    """A busy thread competes for the cores while the curve is measured: the curve stays
    non-decreasing, starts at 1, and a confident draft is still worth verifying."""
    model = tiny_gemma4(seed=2)
    stop = threading.Event()
    worker = threading.Thread(target=_busy, args=(stop,), daemon=True)
    worker.start()
    try:
        engine = engine_for(model, adaptive=True)
    finally:
        stop.set()
        worker.join()
    cost = engine.policy.cost
    assert cost[1] == 1.0 and np.all(cost[1:] >= 1.0)
    assert np.all(np.diff(cost[1:]) >= -1e-12), cost
    n, gain = engine.policy.best_length(np.ones(engine.policy.max_draft), 0.9)
    assert n >= 2 and gain > 1 + MARGIN, (n, gain, cost)


def test_curve_is_kept_and_reused(tmp_path):
    model = tiny_gemma4(seed=2)
    path = tmp_path / "cost-curves.json"
    first = engine_for(model, adaptive=True, cost_cache=path)
    assert any("measured" in n for n in first.notes) and path.exists()
    second = engine_for(model, adaptive=True, cost_cache=path)
    assert any("kept from an earlier start" in n for n in second.notes)
    assert np.array_equal(second.policy.cost, np.round(first.policy.cost, 4))
    again = engine_for(model, adaptive=True, cost_cache=path, remeasure_cost=True)
    assert any("measured" in n for n in again.notes)
    path.write_text("not json")  # a broken file is ignored, then replaced
    assert CostCurveCache(path).get({"max_tokens": 16}) is None
    engine_for(model, adaptive=True, cost_cache=path)
    assert len(CostCurveCache(path)._read()) == 1


def test_a_kept_curve_that_no_longer_holds_is_measured_again(tmp_path):
    """A kept curve is checked at start-up (its largest forward against a step, timed again): one
    kept from a start whose measurement ran beside other work (here: written 3x too steep) is
    measured again and replaced; the note says why."""
    import json

    model = tiny_gemma4(seed=2)
    path = tmp_path / "cost-curves.json"
    first = engine_for(model, adaptive=True, cost_cache=path)
    entries = json.loads(path.read_text())
    steep = [0.0, 1.0] + [3.0 * c for c in entries[0]["curve"][2:]]
    entries[0]["curve"] = steep
    path.write_text(json.dumps(entries))
    second = engine_for(model, adaptive=True, cost_cache=path)
    note = next(n for n in second.notes if n.startswith("verify cost curve"))
    assert "measured in" in note and "no longer held" in note, note
    assert second.policy.cost[-1] < steep[-1] / 2 and abs(second.policy.cost[-1] / first.policy.cost[-1] - 1) < 0.35
    kept = json.loads(path.read_text())
    assert len(kept) == 1 and kept[0]["curve"][-1] < steep[-1] / 2  # replaced, not kept beside
    third = engine_for(model, adaptive=True, cost_cache=path)
    assert any("kept from an earlier start" in n and "checked now" in n for n in third.notes)
