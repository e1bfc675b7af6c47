"""Running a test script's kernels under Triton's interpreter on the CPU (CI has no GPU).

`run_interpreted(script, *args)` runs `python script args...` in a subprocess with TRITON_INTERPRET=1
(it must be set before the kernels are defined, so not in the pytest process) and the project on
the path, asserts it exited 0, and returns its stdout. `run_interpreted_shards(script)` runs a
script whose cases are cut into shards (it takes `shard shards` as its last arguments and does every
shards-th case from `shard` on) in one subprocess a core at once (the interpreter runs on one);
`interpreted_cases(script, tmp_path)` does so for a `main(out, shard, shards)` that saves
(case index, result) pairs, and gives the results in case order.
`interpreter_takes_numpy_2_scalars()` is called by such a script before it launches a kernel."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _interpreter_env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)


def run_interpreted(script, *args, timeout: int = 600) -> str:
    run = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                         env=_interpreter_env(), timeout=timeout)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout


def run_interpreted_shards(script, tmp_path=None, timeout: int = 600) -> list[str]:
    """`python script [out] shard shards` under the interpreter for every shard at once, one
    subprocess a core (the interpreter runs on one; at most two), out = tmp_path/outputs-<shard>.pt
    when tmp_path is given; their stdouts, in shard order."""
    shards = max(1, min(2, os.cpu_count() or 1))
    out = [[str(_shard_output(tmp_path, k))] if tmp_path is not None else [] for k in range(shards)]
    runs = [subprocess.Popen([sys.executable, str(script), *out[k], str(k), str(shards)], env=_interpreter_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for k in range(shards)]
    stdouts = []
    try:
        for run in runs:
            stdout, stderr = run.communicate(timeout=timeout)
            assert run.returncode == 0, stdout[-2000:] + stderr[-4000:]
            stdouts.append(stdout)
    finally:
        for run in runs:  # a shard that failed or timed out leaves no other running
            if run.poll() is None:
                run.kill()
    return stdouts


def _shard_output(tmp_path, shard: int) -> Path:
    return Path(tmp_path) / f"outputs-{shard}.pt"


def interpreted_cases(script, tmp_path, timeout: int = 600) -> list:
    """The results `script`'s main(out, shard, shards) saved ([(case index, result)] for its
    shard), from its shards run at once (`run_interpreted_shards`), merged in case order."""
    import torch

    shards = len(run_interpreted_shards(script, tmp_path, timeout))
    merged = sorted((pair for k in range(shards) for pair in torch.load(_shard_output(tmp_path, k))),
                    key=lambda pair: pair[0])
    assert [i for i, _ in merged] == list(range(len(merged))), "a shard left cases out"
    return [result for _, result in merged]


def interpreter_takes_numpy_2_scalars() -> None:
    """The interpreter reads a kernel's integer arguments as 1-element arrays and turns one into a
    Python int with int(array), which numpy 2 refuses for arrays of one dimension (a kernel's
    `range(0, k_per_split // BLOCK_K)`); read the element instead."""
    import triton.runtime.interpreter as interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
