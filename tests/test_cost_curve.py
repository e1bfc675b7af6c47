"""The verify cost curve: measured robustly (interleaved rounds, medians, a non-decreasing fit),
sensible under an artificial load, and kept on disk so that a restart does not measure again."""
from __future__ import annotations

import threading

import numpy as np
import torch

from server.backend import KEPT_CURVE_TOLERANCE, monotone_fit
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
    measured again and, disagreeing with that measurement too, replaced; the note says why."""
    import json
    import re

    model = tiny_gemma4(seed=2)
    path = tmp_path / "cost-curves.json"
    engine_for(model, adaptive=True, cost_cache=path)
    entries = json.loads(path.read_text())
    steep = [0.0, 1.0] + [3.0 * c for c in entries[0]["curve"][2:]]
    entries[0]["curve"] = steep
    path.write_text(json.dumps(entries))
    second = engine_for(model, adaptive=True, cost_cache=path)
    note = next(n for n in second.notes if n.startswith("verify cost curve"))
    assert "measured in" in note and "no longer held" in note, note
    now = float(re.search(r"checked now: ([0-9.]+)x", note).group(1))
    assert now > 1.0, note  # a 17-token forward timed against a 1-token one, not the other way round
    assert second.policy.cost[-1] < steep[-1] / KEPT_CURVE_TOLERANCE  # not the steep curve
    kept = json.loads(path.read_text())
    assert len(kept) == 1 and kept[0]["curve"][-1] < steep[-1] / KEPT_CURVE_TOLERANCE  # replaced, not kept beside


def test_a_check_that_timed_noise_keeps_the_curve(tmp_path, monkeypatch):
    """A kept curve whose check fails while the whole curve, measured again, agrees with it (the
    check timed a moment's load) is kept, not replaced by the new measurement."""
    import server.engine

    model = tiny_gemma4(seed=2)
    path = tmp_path / "cost-curves.json"
    first = engine_for(model, adaptive=True, cost_cache=path)
    kept_file = path.read_text()
    monkeypatch.setattr(server.engine, "kept_curve_check", lambda *args, **kwargs: (False, 9.0))
    monkeypatch.setattr(server.engine, "curves_agree", lambda measured, kept: True)
    second = engine_for(model, adaptive=True, cost_cache=path)
    note = next(n for n in second.notes if n.startswith("verify cost curve"))
    assert "kept from an earlier start" in note and "measured again" in note and "it agrees" in note, note
    assert np.array_equal(second.policy.cost, np.round(first.policy.cost, 4)) and path.read_text() == kept_file


def test_curves_agree_within_the_tolerance():
    from server.backend import curves_agree

    kept = np.array([0.0, 1.0, 1.5, 2.0])
    assert curves_agree(np.array([0.0, 1.0, 1.4, 2.0 * KEPT_CURVE_TOLERANCE]), kept)
    assert not curves_agree(np.array([0.0, 1.0, 1.4, 2.0 * KEPT_CURVE_TOLERANCE * 1.01]), kept)
    assert not curves_agree(np.array([0.0, 1.0, 1.2, 1.4]), kept)  # 2.0 / 1.4 > 1.35
    assert not curves_agree(np.array([0.0, 1.0, 2.0]), kept)  # another length: other conditions


def test_a_curve_is_kept_for_the_code_that_measured_it(tmp_path):
    """The conditions name the code: a changed kernel source or rebuilt extension gives another
    hash (so another curve is measured), files that run nothing do not."""
    from server.cost_cache import code_identity, conditions, sources_hash

    (tmp_path / "kernels.c").write_text("int f(void) { return 1; }\n")
    (tmp_path / "model.py").write_text("X = 1\n")
    (tmp_path / "_kernels.so").write_bytes(b"\x7fELF-one")
    first = sources_hash(tmp_path)
    (tmp_path / "notes.txt").write_text("not code")
    assert sources_hash(tmp_path) == first
    for name, text in (("kernels.c", b"int f(void) { return 2; }\n"), ("_kernels.so", b"\x7fELF-two"),
                       ("model.py", b"X = 2\n")):
        before = sources_hash(tmp_path)
        (tmp_path / name).write_bytes(text)
        assert sources_hash(tmp_path) != before, name
    cond = conditions("m", torch.device("cpu"), torch.float32, "CpuBackend", 17, 256)
    assert cond["code"] == code_identity() and len(cond["code"]) == 16
