"""bench/drought_ab.py's harness on the CPU (`--tiny`: an uncaptured fast path told that it chains):
every workload runs with the rule off and on, the outputs equal plain decoding (the bench raises
otherwise), and the rule chains where drafts are absent and never where they always come."""
from __future__ import annotations

import json


def test_drought_ab_harness(tmp_path):
    from bench import drought_ab

    assert drought_ab.main(["--tiny", "--rounds", "1", "--gen", "80", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "drought_ab-tiny.json").read_text())
    workloads = record["workloads"]
    assert set(workloads) == {"drought", "mixed", "drafted"}
    for name, runs in workloads.items():
        assert len(runs["off"]) == len(runs["on"]) == 1
        assert runs["off"][0]["chained"] == 0, name   # DROUGHT_STEPS=None: a drafting request never chains
    # no drafts: every plain step after the first DROUGHT_STEPS chains, but the one making the last token
    drought = workloads["drought"]["on"][0]
    assert drought["verify_steps"] == 0 and drought["chained"] == 79 - record["shipped"]
    assert 0 < workloads["mixed"]["on"][0]["chained"] < drought["chained"]
    assert workloads["mixed"]["on"][0]["verify_steps"] > 0
    assert workloads["drafted"]["on"][0]["chained"] == 0
    assert "| drought |" in (tmp_path / "drought_ab-tiny.md").read_text()
