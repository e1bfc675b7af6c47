"""Where benchmark figures go: bench/results/<name>.json (every figure) and <name>.md (the table)."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path


def run_header() -> dict:
    """When and where a run happened, the first two fields of every results record (its markdown's
    header line reads them)."""
    return {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": _machine()}


def write_results(out_dir: Path, name: str, results: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"name": name, **run_header(), **results}
    (out_dir / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(markdown)


def _machine() -> str:
    import os

    return f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}"
