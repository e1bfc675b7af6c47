"""bench/step_matmul_profile.py's report reads Nsight Compute's CSV as ncu writes it (CPU only)."""
import csv
import io

import pytest

from bench import step_matmul_profile as prof

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
          "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]


def ncu_text(launches: int) -> str:
    """ncu --csv --page details output for `launches` kernels, with the driver's lines mixed in:
    launch i lasts 1000 * (i + 1) ns."""
    buf = io.StringIO()
    buf.write("device Test GPU\n==PROF== Connected to process 1\n")
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(HEADER)
    for i in range(launches):
        base = [str(i), "1", "python3", "127.0.0.1", "int4_step_matmul", "1", "7", "(128, 1, 1)", "(320, 1, 1)", "0", "9.0"]
        w.writerow(base + ["GPU Speed Of Light Throughput", "Duration", "ns", f"{1000 * (i + 1):,}"])
        w.writerow(base + ["GPU Speed Of Light Throughput", "DRAM Throughput", "%", "30.5"])
        w.writerow(base + ["GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%", "36.1"])
        w.writerow(base + ["Occupancy", "Achieved Active Warps Per SM", "warp", "9.6"])
        w.writerow(base + ["Scheduler Statistics", "Issued Warp Per Scheduler", "", "0.45"])
        w.writerow(base + ["Scheduler Statistics", "No Eligible", "%", "55.2"])
        w.writerow(base + ["Warp State Statistics", "Warp Cycles Per Issued Instruction", "cycle", "5.3"])
        w.writerow(base + ["Launch Statistics", "Registers Per Thread", "register/thread", "62"])
        w.writerow(base + ["Launch Statistics", "Dynamic Shared Memory Per Block", "byte/block", "16,896"])
        w.writerow(base[:11] + ["Occupancy", "", "", ""])   # ncu's rule rows: no metric
    for rows in prof.ROWS:
        for name, *_ in prof.CALLS:
            buf.write(f"launch {name} | rows {rows} | split 3 | column tile 64 | programs 9\n")
    return buf.getvalue()


def test_report_reads_the_second_launch_of_each_pair(tmp_path):
    n = len(prof.CALLS) * len(prof.ROWS) * prof.CALLS_EACH
    path = tmp_path / "ncu.csv"
    path.write_text(ncu_text(n))
    assert prof.report(path, tmp_path) == 0
    record = (tmp_path / "step_matmul_profile.json").read_text()
    import json
    launches = json.loads(record)["launches"]
    assert [(r["name"], r["rows"]) for r in launches] == [(c[0], r) for r in prof.ROWS for c in prof.CALLS]
    first = launches[0]   # gate|up at one row: IDs 0 and 1, the second lasts 2000 ns
    assert first["duration_ns"] == 2000 and first["split"] == "3" and first["shared_bytes"] == 16896
    assert first["tb_per_s"] == pytest.approx(prof.weight_bytes(20480, 2560) / 2000 / 1e3)
    last = launches[-1]
    assert last["duration_ns"] == 1000 * n
    md = (tmp_path / "step_matmul_profile.md").read_text()
    assert "(Test GPU)" in md and md.count("| gate\\|up |") == 2


def test_report_refuses_a_run_with_other_launches(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text(ncu_text(5))
    with pytest.raises(SystemExit, match="5 profiled launches"):
        prof.report(path, tmp_path)
