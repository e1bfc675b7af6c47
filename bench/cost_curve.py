"""`python -m bench.cost_curve [--starts 4]`: is the verify cost curve the same from one start to the next?

Each start is a fresh process that loads the bundled model and measures the curve as the server does
when none is kept (`Engine(...)` with no curve cache). Prints every curve, and per draft length the
spread across starts, (max - min) / median; the last line is one JSON object with the worst spread
and whether every curve is monotone non-decreasing. Issue bar: within 10 %.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

_ONE_START = """
import json
from server.engine import Engine, EngineConfig
from server.model_loading import load_target
engine = Engine(load_target(None, None, None, None), None, EngineConfig(cost_cache=None))
print(json.dumps([float(c) for c in engine.policy.cost]))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cost_curve", description=__doc__.split("\n")[0])
    p.add_argument("--starts", type=int, default=4)
    args = p.parse_args(argv)
    curves = []
    for k in range(args.starts):
        out = subprocess.run([sys.executable, "-c", _ONE_START], capture_output=True, text=True, check=True)
        curves.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"start {k + 1}: " + " ".join(f"{n}:{c:.2f}" for n, c in enumerate(curves[-1]) if n >= 1),
              file=sys.stderr)
    arr = np.asarray(curves)[:, 1:]
    spread = (arr.max(0) - arr.min(0)) / np.median(arr, 0)
    monotone = bool(np.all(np.diff(arr, axis=1) >= 0))
    print("spread per length: " + " ".join(f"{n + 1}:{s:.1%}" for n, s in enumerate(spread)), file=sys.stderr)
    print(json.dumps({"starts": args.starts, "worst_spread": float(spread.max()), "monotone": monotone}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
