"""bench.gpu_concurrency's harness on the CPU (a tiny Gemma 4, uncaptured): streams in threads on
the fast path's lanes, each stream's tokens against its solo run, the record written. Its times mean
nothing; the GPU machine runs the real one."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_gpu_concurrency_tiny_streams_are_identical_to_solo(tmp_path):
    from bench import gpu_concurrency

    assert gpu_concurrency.main(["--tiny", "--streams", "1,3", "--tokens", "16", "--prompt", "30",
                                 "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_concurrency-tiny.json").read_text())
    one, three = record["runs"]
    assert (one["streams"], three["streams"]) == (1, 3) and all(one["identical"]) and all(three["identical"])
    assert three["forwards"] > 0 and three["peak_streams"] >= 2  # the streams shared forwards
    assert "| 3 |" in (tmp_path / "gpu_concurrency-tiny.md").read_text()
