"""Where a CPU int8 forward's time goes: matmuls, attention and the rest, for a step and a verify.

    python -m bench.cpu_step [--context 1024] [--rows 1 4 16] [--rounds 30] [--out bench/results]

The bundled model on the CPU int8 path (server/cpu_model.py), a cache of `--context` random
tokens; each forward of n rows (1: a decode step, 16: a 16-token verify) is timed `--rounds` times,
the sizes interleaved, with the time inside `cpu_kernels.linear` and the attention kernels
summed per forward (the rest: the norm, gelu and RoPE kernels, cache writes and numpy glue). Medians.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bench.results import run_header, write_results


class _TimedKernels:
    """cpu_kernels with the time of each linear and attention call added to `spent`."""

    def __init__(self, kernels):
        self.kernels, self.spent = kernels, {"linear": 0.0, "attention": 0.0}

    def __getattr__(self, name):  # the rest (rms_norm, KV_DTYPE, ...) as the wrapped kernels have it
        return getattr(self.kernels, name)

    def linear(self, x, lin, out=None):
        return self._timed("linear", self.kernels.linear, x, lin, out=out)

    def attention(self, *args, **kw):
        return self._timed("attention", self.kernels.attention, *args, **kw)

    def attention_many(self, calls):
        return self._timed("attention", self.kernels.attention_many, calls)

    def _timed(self, part: str, kernel, *args, **kw):
        t = time.perf_counter()
        out = kernel(*args, **kw)
        self.spent[part] += time.perf_counter() - t
        return out


def measure(context: int, rows: list[int], rounds: int) -> dict:
    from server import cpu_kernels
    from server.cpu_model import CpuGemma
    from server.model_loading import load_target

    target = load_target(None)
    cpu = CpuGemma.from_hf(target.model)
    timed = _TimedKernels(cpu_kernels)
    cpu.k = timed
    rng = np.random.default_rng(0)
    ids = rng.integers(3, target.model.config.vocab_size, context + max(rows)).tolist()
    cache = cpu.new_cache(context + max(rows) + 1)
    cpu.forward(ids[:context], 0, cache, last_only=True)
    samples: dict[int, list] = {n: [] for n in rows}
    for r in range(rounds + 1):
        for n in rows:
            timed.spent = {"linear": 0.0, "attention": 0.0}
            t0 = time.perf_counter()
            cpu.forward(ids[context:context + n], context, cache)
            total = time.perf_counter() - t0
            if r:  # the first round warms up
                samples[n].append((total, timed.spent["linear"], timed.spent["attention"]))
    out = {}
    for n, s in samples.items():
        total, linear, attention = np.median(np.asarray(s), axis=0) * 1e3
        out[str(n)] = {"total_ms": total, "linear_ms": linear, "attention_ms": attention,
                       "rest_ms": total - linear - attention}
    threads = cpu_kernels._C.get_threads() if cpu_kernels.AVAILABLE else 1
    return {"kernels": "C" if cpu_kernels.AVAILABLE else "numpy", "threads": threads, "rows": out}


def markdown(r: dict) -> str:
    lines = ["# A CPU int8 forward, by part (bundled model)\n",
             f"{r['when']}, {r['machine']}. Command: `{r['command']}`.\n",
             f"{r['context']}-token cache, {r['kernels']} kernels, {r['threads']} threads, median of {r['rounds']} rounds.\n",
             "| rows | forward (ms) | matmuls | attention | rest (norms, RoPE, gelu, glue) | / 1 row |", "|---|---|---|---|---|---|"]
    one = r["rows"].get("1", {}).get("total_ms")
    for n, x in r["rows"].items():
        lines.append(f"| {n} | {x['total_ms']:.2f} | {x['linear_ms']:.2f} | {x['attention_ms']:.2f} | "
                     f"{x['rest_ms']:.2f} | {x['total_ms'] / one:.2f}x |" if one else "")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_step", description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    r = {**run_header(),
         "command": " ".join(["python -m bench.cpu_step", *(sys.argv[1:] if argv is None else argv)]),
         "context": args.context, "rounds": args.rounds, **measure(args.context, sorted(args.rows), args.rounds)}
    md = markdown(r)
    write_results(args.out, "cpu_step", r, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
