"""Start-up progress (common.progress): a phase announces itself, beats while silent, and reports its end."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.progress import phase

ROOT = Path(__file__).resolve().parents[1]


def test_a_silent_phase_beats_at_every_interval_and_reports_its_end():
    lines: list[str] = []
    with phase("waiting", "about 0.5 s", say=lines.append, interval=0.1):
        time.sleep(0.55)
    assert lines[0] == "waiting (about 0.5 s) ..."
    beats = [line for line in lines if line.startswith("  ... waiting: ")]
    assert 3 <= len(beats) <= 6
    assert lines[-1].startswith("waiting: done in 0.")


def test_touching_the_heartbeat_silences_it_and_a_failure_is_reported():
    lines: list[str] = []
    with pytest.raises(RuntimeError):
        with phase("working", say=lines.append, interval=0.2) as beat:
            for _ in range(6):
                time.sleep(0.05)
                beat.touch()  # the work reports its own progress
            raise RuntimeError("boom")
    assert lines[0] == "working ..."
    assert not any(line.startswith("  ...") for line in lines)
    assert lines[-1].startswith("working: failed after ")


def test_the_script_form_passes_output_through_and_keeps_the_exit_status():
    # The Makefile runs the file as a script with the system python, before any virtual environment exists.
    done = subprocess.run([sys.executable, str(ROOT / "common" / "progress.py"), "echoing", "instant", "--",
                           sys.executable, "-c", "print('hello'); raise SystemExit(3)"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stderr.splitlines()[0] == "echoing (instant) ..."
    assert "hello" in done.stderr and "echoing: failed after" in done.stderr
    usage = subprocess.run([sys.executable, str(ROOT / "common" / "progress.py"), "no command"],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 1 and "usage" in usage.stderr
