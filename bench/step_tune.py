"""Measure the int4 step matmul's launch configurations on this GPU and write the fastest into the table.

    python -m bench.step_tune [--rounds 5] [--table server/step_tilings.json] [--out bench/results]   (GPU)

Contract: for every int4 linear shape of one E4B forward (from bench/configs/gemma4-e4b-text-config.json:
q|k|v or q alone, o, gate|up, down, the per-layer gate and projection, the per-layer model
projection), called the way a step calls it (split-K slices left for the next kernel to sum, the
gelu pairs or gelu-times epilogues), on cold weights (each call a different copy of the weight, the
copies past the L2 cache: bench/small_m_bench.py `--cold`), at 1, 8, 16, 32 and 64 rows, it times
every configuration with the linear's own K slices (server/step_tilings.py `Launch`: the Gluon
kernel's tilings at 2 and 3 stages, the Triton kernel as built). The configurations alternate within
each of `--rounds` rounds (a slow spell of the machine hits all), and each figure is the median
over rounds. A configuration replaces the rules' (server/small_m_matmul.py `SmallMLinear.launch`
with TUNED off) only where its median is at least MARGIN faster; every one must give the rules'
output bit for bit (checked at 1 and 64 rows; a mismatch is refused and reported).

Writes this GPU model's entry into `--table` (other GPU models' entries kept) and DIR/step_tune.json
and .md: per shape and row count the rules' time, the chosen configuration's and its gain, and
per forward (each shape times its count in E4B) the rules' and the table's sums.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.results import write_results
from bench.small_m_bench import COLD_BYTES, random_int4_copies

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "bench" / "configs" / "gemma4-e4b-text-config.json"
TUNE_ROWS = (1, 8, 16, 32, 64)
MARGIN = 0.03            # a configuration must beat the rules' by this fraction to replace them
# Row counts below this keep the rules' launch (measured and reported, not chosen). Why: on an H100
# (bench/results/step_tune-h100.md, then `python -m bench.step_ab --base-set
# server.small_m_matmul.TUNED=False --head-set server.small_m_matmul.TUNED=True --rows 32 64`,
# bench/results/step_ab-tuned-h100.md) the cold per-shape choices at 8 and 16 rows (deeper rings,
# 128-column tiles) summed 2.15 -> 1.94 ms a 16-row forward, yet made a whole 16-token verify slower,
# 4.17 -> 4.42 ms, while those at 32 and 64 rows made whole steps faster (4.88 -> 4.77, 7.66 ->
# 7.19 ms): alone on cold weights a launch does not meet the kernels around it in a step.
CHOOSE_FROM_ROWS = 32
STAGES = (2, 3)


def e4b_shapes(config: dict) -> list[tuple[str, int, int, int, str]]:
    """(name, N, K, count a forward, how a step calls it) for every int4 linear of the config's model:
    "slices" (the partials summed by the next kernel), "pairs" (gelu(gate) * up in the epilogue),
    "times" (gelu(y) * u in the epilogue)."""
    layers, shared = config["num_hidden_layers"], config.get("num_kv_shared_layers", 0)
    heads, kv_heads, hidden = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    ple = config.get("hidden_size_per_layer_input", 0)
    counts: dict[tuple, int] = {}
    for i, kind in enumerate(config["layer_types"]):
        d = config["global_head_dim"] if kind == "full_attention" else config["head_dim"]
        owns_kv = i < layers - shared
        tag = "full" if kind == "full_attention" else "sliding"
        qkv = ((f"qkv {tag}", heads * d + 2 * kv_heads * d) if owns_kv else (f"q {tag}", heads * d))
        for key in ((qkv[0], qkv[1], hidden, "slices"), (f"o {tag}", hidden, heads * d, "slices"),
                    ("gate|up", 2 * config["intermediate_size"], hidden, "pairs"),
                    ("down", hidden, config["intermediate_size"], "slices")) + (
                ((("ple gate", ple, hidden, "times"), ("ple proj", hidden, ple, "slices")) if ple else ())):
            counts[key] = counts.get(key, 0) + 1
    shapes = [(name, n, k, c, mode) for (name, n, k, mode), c in counts.items()]
    if ple:
        shapes.append(("ple model proj", layers * ple, hidden, 1, "slices"))
    return shapes


def candidates(n: int) -> list:
    """Every Launch with a linear's own K slices that an N-column int4 linear can take."""
    from server import gluon_matmul
    from server.small_m_matmul import NUM_STAGES, _block_n
    from server.step_tilings import Launch
    out = [Launch("gluon", block_n, warps, stages) for block_n, warps in gluon_matmul.TILINGS
           for stages in STAGES if n % block_n == 0 and block_n >= _block_n(n)]
    return out + [Launch("triton", _block_n(n), 4, NUM_STAGES)]


def call(lin, mode: str, x: torch.Tensor, u: torch.Tensor):
    """One step's use of `lin` (see e4b_shapes); gelu-times only up to the rows a step fuses it."""
    from server.fast_path import PLE_GELU_FUSED_ROWS
    if mode == "slices":
        return lin.slices(x)
    if mode == "times" and x.shape[0] <= PLE_GELU_FUSED_ROWS:
        return lin(x, gelu_times=u[:x.shape[0]])
    return lin(x)


def tune_shape(name: str, n: int, k: int, count: int, mode: str, rounds: int) -> dict:
    from server import small_m_matmul
    from server.small_m_matmul import SmallMLinear, share_partials

    weight_bytes = n * k // 2 + 2 * 2 * (k // 128) * n
    weights = random_int4_copies(n, k, max(2, min(64, COLD_BYTES // weight_bytes)))
    x64 = torch.randn(max(TUNE_ROWS), k, device="cuda", dtype=torch.bfloat16)
    u64 = torch.randn(max(TUNE_ROWS), n, device="cuda", dtype=torch.bfloat16)
    rules = [SmallMLinear(w, s, o, n, k, tuned=False) for w, s, o in weights]
    saved, small_m_matmul.TUNED = small_m_matmul.TUNED, False
    try:
        default = {m: rules[0].launch(m) for m in TUNE_ROWS}
    finally:
        small_m_matmul.TUNED = saved
    configs = candidates(n)
    lins = {}
    for c in configs:
        built = [SmallMLinear(w, s, o, n, k, split=rules[0].split, tuned=False) for w, s, o in weights]
        for lin in built:
            lin.tuned = {max(TUNE_ROWS): c}      # every call on c (TUNED on: the table's path)
        lins[c] = [lin.gelu_pairs() for lin in built] if mode == "pairs" else built
    base = [lin.gelu_pairs() for lin in rules] if mode == "pairs" else rules
    share_partials([lin for group in lins.values() for lin in group] + base)
    row = {"name": name, "n": n, "k": k, "count": count, "mode": mode, "split": rules[0].split,
           "copies": len(weights), "rows": {}}
    small_m_matmul.TUNED = True
    try:
        want = {m: call(base[0], mode, x64[:m], u64).clone() for m in (1, max(TUNE_ROWS))}
        refused = [c for c in configs
                   if not all(torch.equal(call(lins[c][0], mode, x64[:m], u64), want[m]) for m in want)]
        configs = [c for c in configs if c not in refused]
        graphs = {}
        for m in TUNE_ROWS:
            for c in configs:
                fn = lambda c=c, m=m: [call(lin, mode, x64[:m], u64) for lin in lins[c]]
                fn()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                graphs[m, c] = g
        times = {key: [] for key in graphs}
        for _ in range(rounds):
            for key, g in graphs.items():
                g.replay()
                reps = []
                for _ in range(3):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record(); g.replay(); e.record(); e.synchronize()
                    reps.append(s.elapsed_time(e) * 1e3 / len(weights))
                times[key].append(statistics.median(reps))
    finally:
        small_m_matmul.TUNED = saved
    for m in TUNE_ROWS:
        row["rows"][m] = {"rules": list(default[m]),
                          "all_us": {label(c): statistics.median(times[m, c]) for c in configs},
                          "spread_us": {label(c): [min(times[m, c]), max(times[m, c])] for c in configs}}
    row["refused"] = [list(c) for c in refused]
    choose(row)
    print(json.dumps({key: row[key] for key in ("name", "n", "k", "refused")}
                     | {"rows": {m: (r["rules_us"], r["chosen"], r["chosen_us"]) for m, r in row["rows"].items()}}),
          flush=True)
    return row


def label(c) -> str:
    return f"{c[0]} n{c[1]} w{c[2]} s{c[3]}"


def choose(row: dict) -> None:
    """Each row count's choice from its medians (row["rows"][m]["all_us"]): the fastest where it beats
    the rules' by MARGIN, from CHOOSE_FROM_ROWS rows on; else the rules'. Sets best, chosen and their times."""
    for m, e in row["rows"].items():
        by_label = {label(c): c for c in candidates(row["n"])}
        med = {by_label[name]: us for name, us in e["all_us"].items()}
        rules = tuple(e["rules"])
        best = min(med, key=med.get)
        faster = int(m) >= CHOOSE_FROM_ROWS and med[best] < med[rules] * (1 - MARGIN)
        chosen = best if faster else rules
        e.update(rules_us=med[rules], best=list(best), best_us=med[best], chosen=list(chosen), chosen_us=med[chosen])


def write_table(path: Path, device: str, row: dict) -> None:
    """One measured shape (every row count) into this device's entry of the table at `path` (written
    after each shape, so a run cut short keeps what it measured)."""
    from server.step_tilings import parse_table, shape_key
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(device, {})[shape_key(row["n"], row["k"])] = {str(m): e["chosen"] for m, e in row["rows"].items()}
    parse_table(table)
    # one line a shape: {device: {shape: {rows: launch}}}
    lines = []
    for d, shapes in sorted(table.items()):
        body = ",\n".join(f"  {json.dumps(shape)}: {json.dumps(by_rows)}" for shape, by_rows in sorted(shapes.items()))
        lines.append(f" {json.dumps(d)}: {{\n{body}\n }}")
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def report(device: str, rounds: int, rows: list[dict]) -> tuple[dict, str]:
    """(results, markdown) of a tuning run."""
    forward = {m: {which: sum(r["rows"][m][f"{which}_us"] * r["count"] for r in rows) / 1e3
                   for which in ("rules", "chosen", "best")} for m in TUNE_ROWS}
    lines = [f"# The int4 step matmul's launches tuned ({device})", "",
             f"`python -m bench.step_tune --rounds {rounds}`: E4B's int4 shapes called as a step calls them, "
             f"cold weights, microseconds a call (median of {rounds} rounds, configurations alternating). "
             f"rules: server/small_m_matmul.py's choice without the table; chosen (->): the table's entry, the "
             f"fastest where at least {MARGIN:.0%} faster than the rules, from {CHOOSE_FROM_ROWS} rows on; below "
             f"that the rules stay and the fastest is only reported (best, see CHOOSE_FROM_ROWS). Every "
             "configuration gave the rules' bits unless listed as refused.", "",
             "| layer | N | K | x/forward | call | " + " | ".join(f"{m} rows" for m in TUNE_ROWS) + " |",
             "|---|---|---|---|---|" + "---|" * len(TUNE_ROWS)]
    for r in rows:
        cells = []
        for m in TUNE_ROWS:
            e = r["rows"][m]
            if e["chosen"] != e["rules"]:
                cells.append(f"{e['rules_us']:.1f} -> {e['chosen_us']:.1f} ({label(e['chosen'])})")
            elif e["best"] != e["rules"] and e["best_us"] < e["rules_us"] * (1 - MARGIN):
                cells.append(f"{e['rules_us']:.1f} (best {e['best_us']:.1f}, {label(e['best'])})")
            else:
                cells.append(f"{e['rules_us']:.1f}")
        refused = f" (refused: {', '.join(label(c) for c in r['refused'])})" if r["refused"] else ""
        lines.append(f"| {r['name']}{refused} | {r['n']} | {r['k']} | {r['count']} | {r['mode']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Per forward, ms (each shape's time x its count), rules -> the table (the fastest of each): "
              + "; ".join(f"{m} rows {f['rules']:.3f} -> {f['chosen']:.3f} ({f['best']:.3f})"
                          for m, f in forward.items()) + "."]
    results = {"device": device, "rounds": rounds, "margin": MARGIN, "choose_from_rows": CHOOSE_FROM_ROWS,
               "shapes": rows, "per_forward_ms": forward}
    return results, "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_tune")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--table", type=Path, default=ROOT / "server" / "step_tilings.json")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--rechoose", type=Path, metavar="STEP_TUNE_JSON",
                   help="no measuring: choose again from a run's step_tune.json (this file's rules now) and "
                        "write the table and the report from it (any machine)")
    args = p.parse_args(argv)
    if args.rechoose:
        saved = json.loads(args.rechoose.read_text())
        device, rounds, rows = saved["device"], saved["rounds"], saved["shapes"]
        for row in rows:
            row["rows"] = {int(m): e for m, e in row["rows"].items()}
            choose(row)
            write_table(args.table, device, row)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench.step_tune measures a CUDA GPU; none here")
        device, rounds, rows = torch.cuda.get_device_name(), args.rounds, []
        for shape in e4b_shapes(json.loads(CONFIG.read_text())):
            rows.append(tune_shape(*shape, rounds=rounds))
            write_table(args.table, device, rows[-1])
    results, md = report(device, rounds, rows)
    write_results(args.out, "step_tune", results, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
