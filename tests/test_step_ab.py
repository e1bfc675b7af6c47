"""bench.step_ab's harness, end to end on the CPU: the last commit exported beside this checkout,
each measured in its own process (imports from its own tree), results written. The tiny model's
times mean nothing; the figures the README quotes come from the GPU machine."""
from __future__ import annotations

import json
import re

import pytest


@pytest.mark.slow
def test_step_ab_tiny_runs_both_versions(tmp_path):
    from bench import step_ab

    assert step_ab.main(["--tiny", "--rounds", "1", "--reps", "5", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "step_ab-tiny.json").read_text())
    for name in ("base", "head"):
        (sample,) = record["samples"][name]
        assert sample["drafted_equals_plain"] and sample["step1_ms"] > 0 and sample["kernels_per_step"] is None
    assert "| one-token step, ms |" in (tmp_path / "step_ab-tiny.md").read_text()


@pytest.mark.slow
def test_step_ab_compares_one_switch_within_one_tree(tmp_path):
    """--base-tree . with --base-set / --head-set: the same code, a module setting off against on
    (recorded with each sample); a setting that cannot be honoured (a name the module lacks, a value
    that is no literal or of another type, the harness's own constants) is refused before any round."""
    from bench import step_ab

    flag, wide = "server.fast_path.SUMMED_SLICES", "server.small_m_matmul.WIDE_FROM_ROWS"
    assert step_ab.main(["--tiny", "--rounds", "1", "--reps", "5", "--out", str(tmp_path), "--base-tree",
                         str(step_ab.ROOT), "--base-set", f"{flag}=False", "--base-set", f"{wide}=None",
                         "--head-set", f"{flag}=True", "--rows", "32"]) == 0
    record = json.loads((tmp_path / "step_ab-tiny.json").read_text())
    assert record["samples"]["base"][0]["settings"] == {flag: False, wide: None}   # an `int | None` takes None
    assert record["samples"]["head"][0]["settings"] == {flag: True}
    md = (tmp_path / "step_ab-tiny.md").read_text()
    assert f"head sets `{flag}=True`" in md and "| 32-token step, ms |" in md
    # --rows: each version's 32-token logits hashed; on the CPU neither switch changes a bit
    assert "| 32-token step's logits, the same bits in both | True |" in md
    with pytest.raises(SystemExit):
        step_ab.main(["--tiny", "--rows", "65"])
    for bad in ("server.fast_path.NO_SUCH_FLAG=1", "SUMMED_SLICES", "server.fast_path.SUMMED_SLICES=maybe",
                "server.fast_path.SUMMED_SLICES=", "server.fast_path.SUMMED_SLICES='False'", "bench.step_ab.GEN=8",
                "server.small_m_matmul.WIDE_FROM_ROWS=True", "server.small_m_matmul.WIDE_FROM_ROWS=2.0",
                "server.no_such_module.X=1"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):   # the message names the setting
            step_ab.apply_settings([bad])
        with pytest.raises(ValueError):   # from main, before a round runs (nothing is written)
            step_ab.main(["--tiny", "--rounds", "1", "--out", str(tmp_path / "refused"), "--head-set", bad])
    assert not (tmp_path / "refused").exists()
    assert step_ab.parse_settings(["server.fast_path.PLE_GELU_FUSED_ROWS=8"]) == [
        ("server.fast_path", "PLE_GELU_FUSED_ROWS", 8)]
