"""E4B's int4 step matmuls under Nsight Compute: a driver for `ncu` and a report of what it read.

    ncu --clock-control none --kernel-name regex:int4_step --section SpeedOfLight --section Occupancy \
        --section SchedulerStats --section WarpStateStats --section LaunchStats \
        --section MemoryWorkloadAnalysis --csv --page details \
        python -m bench.step_matmul_profile --drive > ncu.csv                  (GPU machine)
    python -m bench.step_matmul_profile --report ncu.csv [--out DIR]           (any machine)

Contract: `--drive` builds one random int4 weight of each of E4B's step-matmul shapes
(server/small_m_matmul.py's layout and K slices, as the fast path builds them) and calls each as a
one-token step calls it (gate|up with its gelu pairs in the epilogue, the per-layer input gate with
gelu(y) * u in its own, the linears whose partials the next kernel sums through `slices`), twice at
one row, then twice at 16 rows, in the order of `CALLS`; it prints one `launch ...` line per shape
and row count, and the GPU's name. ncu flushes the caches before each launch it profiles (its
default cache control), so every launch reads its weight from memory, as a step does, and runs
alone: no programmatic dependent launch overlaps it with the kernel before, so its duration includes
the ramp a step hides in part. `--report` reads ncu's CSV (the driver's own lines may be mixed in)
and writes DIR/step_matmul_profile.json and .md: for the second launch of each pair, its duration,
the weight's bytes over it, and what the SMs did (achieved warps an SM, instructions issued a
scheduler a cycle, cycles with no warp eligible, registers and shared memory a program).
"""
from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

# (name, N, K, how a one-token step calls it): E4B's sliding-layer shapes and the per-layer input's
CALLS = [("gate|up", 20480, 2560, "gelu_pairs"), ("down", 2560, 10240, "slices"),
         ("q|k|v", 3072, 2560, "slices"), ("o", 2560, 2048, "slices"),
         ("ple gate", 256, 2560, "gelu_times"), ("ple proj", 2560, 256, "slices")]
ROWS = (1, 16)
CALLS_EACH = 2   # a pair: the report reads the second (the first may include one-time host work)

_METRICS = {   # ncu's metric name -> the report's field
    "Duration": "duration_ns", "DRAM Throughput": "dram_pct", "Achieved Active Warps Per SM": "warps_per_sm",
    "Issued Warp Per Scheduler": "issued_per_scheduler", "No Eligible": "no_eligible_pct",
    "Warp Cycles Per Issued Instruction": "cycles_per_issue", "Registers Per Thread": "registers",
    "Dynamic Shared Memory Per Block": "shared_bytes", "Compute (SM) Throughput": "sm_pct",
}


def weight_bytes(n: int, k: int) -> int:
    """An int4 weight's codes and its bf16 scales and offsets (groups of 128 features)."""
    return n * k // 2 + 2 * 2 * (k // 128) * n


def drive() -> int:
    import torch

    from bench.small_m_bench import random_int4_copies
    from server.small_m_matmul import SmallMLinear, share_partials
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    built = []
    for name, n, k, how in CALLS:
        (w, s, o), = random_int4_copies(n, k, 1)
        lin = SmallMLinear(w, s, o, n, k)
        built.append((name, lin.gelu_pairs() if how == "gelu_pairs" else lin, how, n, k))
    share_partials([lin for _, lin, *_ in built])   # one split-K scratch, as a model's linears share it
    for rows in ROWS:
        for name, lin, how, n, k in built:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            u = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            for _ in range(CALLS_EACH):
                if how == "slices":
                    lin.slices(x)
                elif how == "gelu_times":
                    lin(x, gelu_times=u)
                else:
                    lin(x)
            torch.cuda.synchronize()
            print(f"launch {name} | rows {rows} | split {lin.split} | column tile {lin.block_n} | "
                  f"programs {(lin.n // lin.block_n) * lin.split}", flush=True)
    return 0


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text and text != "n/a" else float("nan")


def read_ncu_csv(text: str) -> tuple[list[dict], list[str], str]:
    """(one dict of _METRICS' fields a profiled launch, in launch order; the driver's `launch` lines;
    the device named by the driver) from ncu's CSV with the driver's lines mixed in."""
    lines = text.splitlines()
    launches = [ln.split("launch ", 1)[1] for ln in lines if ln.startswith("launch ")]
    device = next((ln.split("device ", 1)[1] for ln in lines if ln.startswith("device ")), "")
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"ID"'))
    table = [ln for ln in lines[start:] if ln.startswith('"')]
    reader = csv.reader(table)
    header = next(reader)
    col = {name: i for i, name in enumerate(header)}
    by_id: dict[str, dict] = {}
    for row in reader:
        if len(row) <= col["Metric Value"]:
            continue
        field = _METRICS.get(row[col["Metric Name"]])
        record = by_id.setdefault(row[col["ID"]], {"kernel": row[col["Kernel Name"]], "grid": row[col["Grid Size"]]})
        if field and field not in record:
            record[field] = _number(row[col["Metric Value"]])
    return [by_id[i] for i in sorted(by_id, key=int)], launches, device


def _cell(text: str) -> str:
    """`text` inside a markdown table cell (gate|up's bar would end the cell)."""
    return text.replace("|", "\\|")


def report(csv_path: Path, out: Path) -> int:
    from bench.results import write_results
    profiled, launches, device = read_ncu_csv(csv_path.read_text())
    expected = len(CALLS) * len(ROWS) * CALLS_EACH
    if len(profiled) != expected:
        raise SystemExit(f"{csv_path}: {len(profiled)} profiled launches, want {expected} "
                         f"(`--drive` under ncu with --kernel-name regex:int4_step)")
    rows = []
    for i, (rows_n, (name, n, k, how)) in enumerate((r, c) for r in ROWS for c in CALLS):
        got = profiled[i * CALLS_EACH + CALLS_EACH - 1]
        split = re.search(r"split (\d+)", launches[i]).group(1) if i < len(launches) else ""
        rows.append({"name": name, "rows": rows_n, "n": n, "k": k, "call": how, "split": split,
                     "weight_bytes": weight_bytes(n, k),
                     "tb_per_s": weight_bytes(n, k) / got["duration_ns"] / 1e3, **got})
    lines = [f"# E4B's int4 step matmuls under Nsight Compute{f' ({device})' if device else ''}", "",
             f"Command: `ncu --clock-control none --kernel-name regex:int4_step (sections: SpeedOfLight, "
             f"Occupancy, SchedulerStats, WarpStateStats, LaunchStats, MemoryWorkloadAnalysis) --csv "
             f"python -m bench.step_matmul_profile --drive`, then `python -m bench.step_matmul_profile "
             f"--report`. Each launch alone, caches flushed (cold weights), no programmatic dependent "
             f"launch; the second of two calls.", "",
             "| matmul | rows | N x K | K slices | grid | us | weight TB/s | DRAM % of peak | SM % | "
             "warps an SM (achieved) | issued a scheduler a cycle | no warp eligible % | cycles an issue | registers | shared KB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {_cell(r['name'])} | {r['rows']} | {r['n']} x {r['k']} | {r['split']} | {r['grid']} | "
                     f"{r['duration_ns'] / 1e3:.1f} | {r['tb_per_s']:.2f} | {r['dram_pct']:.0f} | {r['sm_pct']:.0f} | "
                     f"{r['warps_per_sm']:.1f} | {r['issued_per_scheduler']:.2f} | {r['no_eligible_pct']:.0f} | "
                     f"{r['cycles_per_issue']:.1f} | {r['registers']:.0f} | {r['shared_bytes'] / 1024:.1f} |")
    for rows_n in ROWS:
        total = sum(r["duration_ns"] for r in rows if r["rows"] == rows_n) / 1e3
        lines.append(f"\nA sliding layer's six at {rows_n} row(s): {total:.1f} us, alone and cold.")
    md = "\n".join(lines) + "\n"
    write_results(out, "step_matmul_profile", {"device": device, "launches": rows}, md)
    print(md)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_matmul_profile")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--drive", action="store_true", help="call each step matmul for ncu to profile (GPU)")
    mode.add_argument("--report", type=Path, metavar="CSV", help="ncu's CSV of a --drive run -> the table")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    return drive() if args.drive else report(args.report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
