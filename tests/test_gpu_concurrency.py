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
    # the forwards' own time: one at a time under the lanes' lock, so their sum fits in the wall
    assert three["forward_ms"] > 0 and 0 < three["forward_share"] <= 1 and three["staging_ms"] is None  # uncaptured
    assert "| 3 |" in (tmp_path / "gpu_concurrency-tiny.md").read_text()


@pytest.mark.slow
def test_gpu_concurrency_tiny_next_turns_resume_from_the_prefix_cache(tmp_path):
    """--turn: each stream's request continues a conversation its lane served before, so its
    prefill covers the new tokens only; --rows caps each stream's draft by the streams sharing."""
    from bench import gpu_concurrency

    assert gpu_concurrency.main(["--tiny", "--streams", "1,3", "--tokens", "16", "--prompt", "30", "--turn", "6",
                                 "--rows", "8", "--no-costs", "--max-len", "200", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_concurrency-rows8-turn6-len200-tiny.json").read_text())
    assert record["max_len"] == 200  # --max-len: the lanes' cache, as the server sizes it
    one, three = record["runs"]
    assert all(one["identical"]) and all(three["identical"]) and three["peak_streams"] >= 2
    assert (one["max_draft"], three["max_draft"]) == (7, 1) and record["forward_costs"] == []
    assert three["prompt_tokens_computed"] == 3 * 6  # each request prefilled its 6 new tokens only
    assert "6 new" in (tmp_path / "gpu_concurrency-rows8-turn6-len200-tiny.md").read_text()


def test_rows_auto_caps_each_streams_draft_as_the_server_caps_a_lane():
    """--rows auto: the drafts the server's lanes would carry at that many streams (FastBatch.rows_for:
    16 rows for one or two lanes, 32 for more; FastTarget.shared_room rounds a share down to a
    bucket, which for these counts is the share itself)."""
    from bench.gpu_concurrency import draft_cap
    from server.fast_batch import shared_rows

    assert [shared_rows(s) for s in (1, 2, 3, 4, 16)] == [16, 16, 32, 32, 32]
    assert [draft_cap(s, "auto") for s in (1, 2, 4, 8, 16)] == [15, 7, 7, 3, 1]
    assert [draft_cap(s, 16) for s in (1, 2, 4, 8, 16)] == [15, 7, 3, 1, 1]
