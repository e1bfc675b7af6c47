"""The CPU kernels (server/_cpu_*.c) on a CPU that is not x86 and a system that is not Linux (an ARM
Mac): built as such, they compile, link and give every output the same bits as this machine's build.

There is no ARM compiler here, so the test builds the sources as such a compiler sees them: each
file included after the system headers with `__x86_64__`, `__i386__` and `__linux__` undefined, so
`HAVE_X86` is 0 and only the portable scalar code remains, and the thread count comes from the CPUs
online (no affinity masks off Linux). Until 12-05 such a build failed twice over: the attention's
plan named constants defined for x86 only, and the module's init called Linux's sched_getaffinity.
The module is loaded beside the installed one, and its matmul_q8, quantize_rows, attention (chains,
a tree, a long cache), attention_many, rms_norm, gelu_mul and rope are compared bit for bit with the
installed module's SIMD path; by the kernels' contract every path gives the same bits. Linux x86
with a C compiler only (the headers' trick needs an x86 glibc); the build takes a few seconds."""
import glob
import importlib.util
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

ck = pytest.importorskip("server._cpu_kernels")

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(glob.glob(str(ROOT / "server" / "_cpu_*.c")))
CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(
    not (CC and sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")),
    reason="needs a C compiler on x86 Linux (builds the non-x86 configuration by undefining x86's macros)")


def _system_headers() -> list[str]:
    """The system headers the sources include, in order (immintrin.h, x86's, aside): included before
    the macros are undefined, since the system's own headers need them."""
    found: list[str] = []
    for path in [ROOT / "server" / "_cpu_kernels.h", *map(Path, SOURCES)]:
        for line in path.read_text().splitlines():
            m = re.match(r"#include <([^>]+)>", line.strip())
            if m and m.group(1) != "immintrin.h" and m.group(1) not in found:
                found.append(m.group(1))
    return found


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The kernels built as on a CPU without x86 (scalar code only), loaded as a second module."""
    out = tmp_path_factory.mktemp("portable")
    include = sysconfig.get_paths()["include"]
    objects = []
    for source in SOURCES:
        wrapper = out / f"{Path(source).stem}_portable.c"
        lines = ["#define PY_SSIZE_T_CLEAN"] + [f"#include <{h}>" for h in _system_headers()]
        lines += ["#undef __x86_64__", "#undef __i386__", "#undef __linux__", f'#include "{source}"']
        wrapper.write_text("\n".join(lines) + "\n")
        obj = wrapper.with_suffix(".o")
        cmd = [CC, "-c", "-O2", "-fPIC", "-pthread", "-Wall", "-Werror=implicit-function-declaration",
               f"-I{include}", f"-I{ROOT / 'server'}", str(wrapper), "-o", str(obj)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0 and "warning" not in done.stderr, f"{Path(source).name}:\n{done.stderr}"
        objects.append(str(obj))
    lib = out / f"_cpu_kernels{sysconfig.get_config_var('EXT_SUFFIX')}"
    done = subprocess.run([CC, "-shared", "-pthread", *objects, "-lm", "-o", str(lib)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    spec = importlib.util.spec_from_file_location("server._cpu_kernels", lib)  # PyInit__cpu_kernels; not in sys.modules
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_the_portable_build_runs_the_scalar_code_only(portable):
    assert portable.paths() == ["scalar"] and portable.simd() == "scalar"
    assert portable.get_threads() >= 1


@pytest.mark.parametrize("m", [1, 3, 16])
def test_matmul_and_quantize_give_the_simd_builds_bits(portable, m):
    rng = np.random.default_rng(m)
    n, k = 200, 352  # K/32 = 11: a last group of 3 blocks; N not a multiple of the tiles
    x = rng.standard_normal((m, k)).astype(np.float32)
    wq = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
    ws = (rng.random((n, k // 32), dtype=np.float32) * 0.02).astype(np.float32)
    xq, xs = ck.quantize_rows(x)
    pq, ps = portable.quantize_rows(x)
    assert _same(xq, pq) and _same(xs, ps)
    want, got = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    ck.matmul_q8(xq, xs, wq, ws, want)
    portable.matmul_q8(xq, xs, wq, ws, got, threads=2)
    assert _same(want, got)


@pytest.mark.parametrize("window, rows, cache", [(0, 1, 40), (8, 5, 40), (0, 4, 1500), (512, 16, 1300)])
def test_attention_gives_the_simd_builds_bits(portable, window, rows, cache):
    rng = np.random.default_rng(rows + cache)
    h, d = 4, 64
    q = rng.standard_normal((rows, h, d)).astype(np.float32)
    k = rng.standard_normal((cache, d)).astype(np.float16)
    v = rng.standard_normal((cache, d)).astype(np.float16)
    pos = np.arange(cache - rows, cache, dtype=np.int64)
    want, got = np.empty_like(q), np.empty_like(q)
    ck.attention(q, k, v, pos, window, 0.125, want)
    portable.attention(q, k, v, pos, window, 0.125, got, threads=2)
    assert _same(want, got)
    # a tree of the same rows' positions: row 2 branches from row 0 (positions = tree_start + depth)
    if rows >= 3:
        start = cache - rows
        anc = np.array([1, 3, 5] + [(1 << (j + 1)) - 1 - 4 for j in range(3, rows)], dtype=np.int64)
        tpos = np.array([start, start + 1, start + 1] + [start + j - 1 for j in range(3, rows)], dtype=np.int64)
        want, got = np.empty_like(q), np.empty_like(q)
        ck.attention(q, k, v, tpos, window, 0.125, want, None, start, anc)
        portable.attention(q, k, v, tpos, window, 0.125, got, None, start, anc)
        assert _same(want, got)


def test_attention_many_and_the_elementwise_kernels_give_the_simd_builds_bits(portable):
    rng = np.random.default_rng(7)
    calls_want, calls_got = [], []
    for rows, cache, window in [(5, 900, 0), (2, 300, 64), (1, 1200, 0)]:
        q = rng.standard_normal((rows, 4, 64)).astype(np.float32)
        k = rng.standard_normal((cache, 64)).astype(np.float16)
        v = rng.standard_normal((cache, 64)).astype(np.float16)
        pos = np.arange(cache - rows, cache, dtype=np.int64)
        calls_want.append((q, k, v, pos, window, 0.125, np.empty_like(q)))
        calls_got.append((q, k, v, pos, window, 0.125, np.empty_like(q)))
    ck.attention_many(calls_want)
    portable.attention_many(calls_got)
    assert all(_same(a[6], b[6]) for a, b in zip(calls_want, calls_got))

    x = rng.standard_normal((3, 640)).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    res = rng.standard_normal((3, 640)).astype(np.float32)
    want, got = np.empty_like(x), np.empty_like(x)
    ck.rms_norm(x, w, 1e-6, want, res.copy())
    portable.rms_norm(x, w, 1e-6, got, res.copy())
    assert _same(want, got)
    u = rng.standard_normal((3, 640)).astype(np.float32)
    want, got = np.empty_like(x), np.empty_like(x)
    ck.gelu_mul(x, u, want)
    portable.gelu_mul(x, u, got)
    assert _same(want, got)
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    cos, sin = rng.standard_normal((3, 64)).astype(np.float32), rng.standard_normal((3, 64)).astype(np.float32)
    want, got = np.empty_like(x), np.empty_like(x)
    ck.rope(x, cos, sin, want)
    portable.rope(x, cos, sin, got)
    assert _same(want, got)
