"""Measured verify cost curves, kept on disk so that a restart does not measure again.

Contract: `CostCurveCache(path)` maps the conditions of a measurement (model, device, dtype,
backend path, forward sizes, context, torch version, threads: `conditions(...)`) to the curve
measured under them, and the code that runs the forwards (`code_identity()`: a hash of the server
package's sources and compiled kernels, so a changed kernel, which can move a verify's cost by tens
of percent and still pass the start-up check, measures again; the whole package is a superset, so
any change to it measures once). `get(conditions)` returns the kept curve or None;
`put(conditions, curve, seconds)` keeps one. The file is JSON, written atomically (a temporary
file, then a rename); a file that cannot be read is treated as empty and replaced on the next `put`. A curve is used only
when every condition matches exactly: a new device, dtype, path or thread count measures again,
and so does `--remeasure-cost`. The engine also checks a kept curve before it uses it
(server/backend.py `kept_curve_check`) and replaces one that no longer holds.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def conditions(model_id: str, device: torch.device, dtype, backend: str, max_tokens: int, context: int) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}"
    return {"model": model_id, "device": name, "dtype": str(dtype).removeprefix("torch."), "backend": backend,
            "max_tokens": int(max_tokens), "context": int(context), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "code": code_identity()}


@functools.lru_cache(maxsize=1)
def code_identity() -> str:
    """A short hash of what runs a forward: the server package's sources and compiled kernels
    (`sources_hash` of its directory), computed once per process."""
    return sources_hash(Path(__file__).resolve().parent)


def sources_hash(directory: Path) -> str:
    """A short hash of a directory's Python and C sources and compiled extensions (their build
    flags included): names and bytes, in name order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).iterdir() if p.suffix in (".py", ".c", ".so", ".pyd")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


class CostCurveCache:
    def __init__(self, path: Path):
        self.path = Path(path)

    def _read(self) -> list:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, list) else []
        except (OSError, ValueError):
            return []

    def get(self, cond: dict) -> np.ndarray | None:
        for entry in self._read():
            if isinstance(entry, dict) and entry.get("conditions") == cond:
                curve = entry.get("curve")
                if isinstance(curve, list) and len(curve) == cond["max_tokens"] + 1:
                    return np.asarray(curve, dtype=np.float64)
        return None

    def put(self, cond: dict, curve: np.ndarray, seconds: float) -> None:
        entries = [e for e in self._read() if isinstance(e, dict) and e.get("conditions") != cond]
        entries.append({"conditions": cond, "curve": [round(float(c), 4) for c in curve],
                        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(seconds, 1)})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".cost-curves.")
        with os.fdopen(fd, "w") as f:
            json.dump(entries[-64:], f, indent=1)
        os.replace(tmp, self.path)
