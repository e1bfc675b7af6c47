"""Measured launch configurations of the int4 step matmul, per GPU model, linear shape and row count.

Contract: `tuned_launches(device_name, n, k)` gives the configurations `python -m bench.small_m_bench
--tune` measured fastest for an N x K int4 linear on that GPU model, as {rows: Launch}, or None where
that GPU or shape was not measured (server/small_m_matmul.py then keeps its rules: the linear's own
tiling, WIDE_TILING from WIDE_FROM_TILES row tiles on). `launch_for(launches, m)` picks the entry
for a call of m rows: the smallest measured row count at or above m. The table is
server/step_tilings.json, {device name: {"NxK": {"rows": [kernel, block_n, warps, stages]}}},
written by the tuner and committed with the figures behind it (bench/results/small_m_tune*.md).

Invariant: a configuration changes only how a launch is cut, never its sums. Every entry keeps the
linear's own K slices (server/small_m_matmul.py plans them from the shape alone), and a column's
sum does not depend on its column tile, its warp, the ring's depth or which of the two kernels
runs it, so every entry gives the bits of every other at every row count
(tests/test_step_kernel_rows.py, over the shipped table's entries). A table can make steps faster
or slower, never different: drafted output stays plain output whatever it says.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

TABLE = Path(__file__).with_name("step_tilings.json")
KERNELS = ("gluon", "triton")


class Launch(NamedTuple):
    """How one launch is cut: the kernel (server/gluon_matmul.py's "gluon" or server/gpu_kernels.py's
    "triton"), columns a program, warps, and pipeline stages (the Gluon ring's groups / Triton's
    num_stages)."""
    kernel: str
    block_n: int
    warps: int
    stages: int


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def parse_table(raw: dict) -> dict[str, dict[str, dict[int, Launch]]]:
    """The JSON table checked and typed: a malformed entry raises ValueError naming it (a shipped
    table that fails here fails its test, not a server's first step)."""
    out: dict[str, dict[str, dict[int, Launch]]] = {}
    for device, shapes in raw.items():
        out[device] = {}
        for shape, by_rows in shapes.items():
            n, _, k = shape.partition("x")
            if not (n.isdigit() and k.isdigit()):
                raise ValueError(f"{device}: shape {shape!r} is not NxK")
            entry = {}
            for rows, launch in by_rows.items():
                if not (isinstance(launch, list) and len(launch) == 4 and launch[0] in KERNELS
                        and all(isinstance(v, int) and v > 0 for v in launch[1:])):
                    raise ValueError(f"{device} {shape} rows {rows}: {launch!r} is not [kernel, block_n, warps, stages]")
                entry[int(rows)] = Launch(*launch)
            out[device][shape] = dict(sorted(entry.items()))
    return out


@lru_cache(maxsize=1)
def _table() -> dict:
    return parse_table(json.loads(TABLE.read_text())) if TABLE.exists() else {}


def tuned_launches(device_name: str, n: int, k: int) -> dict[int, Launch] | None:
    return _table().get(device_name, {}).get(shape_key(n, k))


def launch_for(launches: dict[int, Launch], m: int) -> Launch | None:
    """The entry for m rows (launches sorted by rows): the smallest measured row count >= m, else None."""
    for rows, launch in launches.items():
        if rows >= m:
            return launch
    return None
