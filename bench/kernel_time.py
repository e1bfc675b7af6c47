"""GPU time by kernel name from a torch.profiler trace, overlapping launches counted once.

Contract: `charge(kernels, idle_gap_us)` takes (start_us, end_us, name) of the CUDA events of a
trace and cuts their span into pieces that do not overlap, each charged to one kernel name (cut to
90 characters: kernels of one template can share them): a kernel from the later of its start and
the previous kernel's end, since under programmatic dependent launch a kernel starts while the one
before it runs, then waits. A gap between kernels shorter than `idle_gap_us` is charged to "(idle)";
longer ones (the host's) to nothing (None: no gap is charged). Returns {name: us}, largest first.
`cuda_kernels(prof)` lists a profile's CUDA events in that form.
"""
from __future__ import annotations


def cuda_kernels(prof) -> list[tuple[float, float, str]]:
    import torch

    return sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])


def charge(kernels: list[tuple[float, float, str]], idle_gap_us: float | None) -> dict[str, float]:
    charged: dict[str, float] = {}
    if not kernels:
        return charged
    covered = kernels[0][0]
    for start, end, name in kernels:
        if idle_gap_us is not None and covered < start < covered + idle_gap_us:
            charged["(idle)"] = charged.get("(idle)", 0.0) + (start - covered)
        if end > max(start, covered):
            charged[name[:90]] = charged.get(name[:90], 0.0) + end - max(start, covered)
        covered = max(covered, end)
    return dict(sorted(charged.items(), key=lambda kv: -kv[1]))
