"""The CPU path's kernels: `linear(x, lin)` (x float32 [M, K] times an Int8Linear's W^T, activations
quantized per row and 32-value block to int8) and `attention(q, k_cache, v_cache, positions, window,
scale)` (`attention_many` for several sequences' at once), each row on its own, and the forward's
glue: `rms_norm` (with the residual add after it), `gelu_mul` and `rope`.

Contract: all return float32 arrays; row i of a result depends only on row i of the inputs (and the
cache), never on M or on the thread count: the C kernels (server/_cpu_kernels.c) split work by
output column and keep each row's arithmetic one fixed sequence. Without the C extension (a machine
that could not build it) the numpy twins below compute the same definitions, row-independently,
much slower (linear and attention to the bit, rope too; the norm and gelu to float rounding);
`AVAILABLE` says which is in use. The K/V cache is float16 (`KV_DTYPE`).
"""
from __future__ import annotations

import os

import numpy as np

try:
    from server import _cpu_kernels as _C
except ImportError:  # not built here: the numpy twins
    _C = None
if os.environ.get("SAILFISH_PURE_PYTHON"):
    _C = None

AVAILABLE = _C is not None
# The K/V cache's dtype (server/cpu_model.py KVCache): half the bytes of float32 for attention to
# read and the prefix cache to keep; the kernels read each value as its exact float32.
KV_DTYPE = np.float16


def set_threads(n: int) -> None:
    if _C is not None:
        _C.set_threads(int(n))


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes, fp32 scales per 32 values) of each row of x float32 [M, K] (Q8_0's rule)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return _C.quantize_rows(x) if _C is not None else quantize_rows_numpy(x)


def pack_weight(codes: np.ndarray, scales: np.ndarray) -> np.ndarray | None:
    """W's codes [N, K] and scales [N, K/32] in the C kernels' SIMD layout (uint8, 64-byte aligned;
    see pack_q8 in server/_cpu_kernels.c), or None without the C kernels. Computed once per weight:
    `linear` hands it to matmul_q8, which otherwise packs W on every call."""
    if _C is None or codes.dtype != np.int8:  # not int8 codes (a test's float stand-ins): nothing to pack
        return None
    codes, scales = np.ascontiguousarray(codes), np.ascontiguousarray(scales, dtype=np.float32)
    size = _C.packed_size(*codes.shape)
    buf = np.empty(size + 64, dtype=np.uint8)
    at = -buf.ctypes.data % 64
    return _C.pack_q8(codes, scales, buf[at : at + size])


def linear(x: np.ndarray, lin, out: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] times lin's W^T: lin.codes / lin.scales (Q8_0), and lin.packed (pack_weight of them,
    or None: matmul_q8 packs per call). `out`: a float32 [M, N] array to write (None: a new one)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if _C is None:
        result = _linear_numpy(x, lin.codes, lin.scales)
        if out is None:
            return result
        out[...] = result
        return out
    xq, xs = _C.quantize_rows(x)
    if out is None:
        out = np.empty((x.shape[0], lin.codes.shape[0]), dtype=np.float32)
    _C.matmul_q8(xq, xs, lin.codes, lin.scales, out, packed=getattr(lin, "packed", None))
    return out


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray,
              window: int, scale: float, tree_start: int = -1, ancestors: np.ndarray | None = None) -> np.ndarray:
    """`ancestors` (int64 [M] bit masks over the step's slots from `tree_start`): a token tree's rows
    (see the C source's contract); None: a chain."""
    if _C is None:
        return _attention_numpy(q, k_cache, v_cache, positions, window, scale, np.empty_like(q), tree_start, ancestors)
    q, k_cache, v_cache, positions, window, scale, out, *tree = _c_call(q, k_cache, v_cache, positions, window, scale,
                                                                       tree_start, ancestors)
    _C.attention(q, k_cache, v_cache, positions, window, scale, out, None, *tree)
    return out


def attention_many(calls: list[tuple]) -> list[np.ndarray]:
    """Several `attention` calls at once (each a tuple of its arguments: q, k_cache, v_cache,
    positions, window, scale[, tree_start, ancestors]), each result `attention`'s to the bit: the
    sequences of a batched forward, which the C kernel runs side by side on its threads rather than
    one after another, each split over them (see attention_many in the C source)."""
    if _C is None:
        return [attention(*call) for call in calls]
    packed = [_c_call(*call) for call in calls]
    _C.attention_many(packed)
    return [call[6] for call in packed]


def _c_call(q, k_cache, v_cache, positions, window, scale, tree_start=-1, ancestors=None) -> tuple:
    """An attention call's arguments as the C kernels take them, with a new out: (q, k_cache,
    v_cache, positions, window, scale, out[, tree_start, ancestors])."""
    tree = () if ancestors is None else (int(tree_start), np.ascontiguousarray(ancestors, dtype=np.int64))
    return (q, k_cache, v_cache, np.ascontiguousarray(positions, dtype=np.int64), int(window), float(scale),
            np.empty_like(q), *tree)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, residual: np.ndarray | None = None) -> np.ndarray:
    """[residual +] RMSNorm over x's last axis times weight (None: no scale), float32, each row on
    its own; x's shape. The C kernel's sequence (see its contract), or rms_norm_numpy's."""
    if _C is None:
        return rms_norm_numpy(x, weight, eps, residual)
    shape, n = x.shape, x.shape[-1]
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, n)
    out = np.empty_like(rows)
    res = None if residual is None else np.ascontiguousarray(residual, dtype=np.float32).reshape(-1, n)
    w = None if weight is None else np.ascontiguousarray(weight, dtype=np.float32)
    _C.rms_norm(rows, w, float(eps), out, res)
    return out.reshape(shape)


def rms_norm_numpy(x: np.ndarray, weight: np.ndarray | None, eps: float, residual: np.ndarray | None = None) -> np.ndarray:
    var = np.einsum("...i,...i->...", x, x, dtype=np.float32) / np.float32(x.shape[-1])
    out = x * (1.0 / np.sqrt(var + np.float32(eps)))[..., None].astype(np.float32)
    out = out * weight if weight is not None else out
    return out if residual is None else residual + out


def gelu_mul(gate: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
    """gelu_tanh(gate) * up, float32 [R, N]; up None: gate [R, 2N] holds gate | up (a fused gate_up
    projection). The C kernels' gelu_sf (as x * sigmoid(2z), within a few ulp), or the same form in numpy."""
    if _C is None:
        return gelu_mul_numpy(gate, up)
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    up = None if up is None else np.ascontiguousarray(up, dtype=np.float32)
    out = np.empty((gate.shape[0], gate.shape[1] if up is not None else gate.shape[1] // 2), dtype=np.float32)
    return _C.gelu_mul(gate, up, out)


def gelu_mul_numpy(gate: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
    if up is None:
        gate, up = gate[:, : gate.shape[1] // 2], gate[:, gate.shape[1] // 2 :]
    z = np.float32(np.sqrt(2.0 / np.pi)) * (gate + np.float32(0.044715) * gate * gate * gate)
    e = np.exp(np.float32(-2.0) * np.abs(z))  # gelu_sf's x * sigmoid(2z), numpy's exp
    return (gate * (np.where(z >= 0, np.float32(1.0), e) / (np.float32(1.0) + e)) * up).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding of x [M, H, D] at each row's cos / sin [M, D]: x * cos + rotated * sin with
    rotated = (-x[D/2:], x[:D/2]), numpy's operations (the C code's bits are numpy's)."""
    if _C is None:
        return rope_numpy(x, cos, sin)
    x = np.ascontiguousarray(x, dtype=np.float32)
    return _C.rope(x, np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32),
                   np.empty_like(x))


def rope_numpy(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).astype(np.float32)


def quantize_rows_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0's rule per row and 32-value block: scale max|x| / 127, codes round-half-even(x / scale)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    scale = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(blocks / safe[:, :, None]), -127, 127).astype(np.int8)
    return codes.reshape(m, k), scale


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fmaf(a, b, c) elementwise on float32 arrays, correctly rounded (C's fmaf), for products exact
    in float64 (a's and b's significands together within 53 bits: true of matmul_q8's scale product
    times an int32 dot below 2**24). The sum is taken in float64 round-to-odd (TwoSum gives the
    rounding error; an inexact sum keeps its truncation with the last bit set), which rounds to
    float32 exactly as one rounding of the exact a * b + c would (53 >= 24 + 2)."""
    p = a.astype(np.float64) * b.astype(np.float64)  # exact
    q = c.astype(np.float64)
    s = p + q
    v = s - p
    err = (p - (s - v)) + (q - v)  # exact: s + err == p + q
    inexact = err != 0
    if inexact.any():
        # truncation toward zero: s itself when err points away from zero, else one step toward zero
        trunc = np.where((err > 0) == (s > 0), s, np.nextafter(s, 0.0))
        odd = (trunc.view(np.int64) | 1).view(np.float64)
        s = np.where(inexact, odd, s)
    return s.astype(np.float32)


def _linear_numpy(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """matmul_q8's definition (server/_cpu_kernels.c), bit for bit: per block b an exact int32 dot,
    acc[b % 4] = fmaf(xs * ws, dot, acc[b % 4]) in block order, out = (acc0 + acc1) + (acc2 + acc3)."""
    xq, xs = quantize_rows_numpy(x)
    m, k = xq.shape
    nb = k // 32
    out = np.empty((m, codes.shape[0]), dtype=np.float32)
    w = codes.reshape(codes.shape[0], nb, 32).astype(np.int32)
    for i in range(m):  # a row at a time: nothing depends on M
        dots = np.einsum("bk,nbk->nb", xq[i].reshape(nb, 32).astype(np.int32), w).astype(np.float32)  # exact
        s = xs[i][None, :] * scales  # the scale products, rounded to float32
        acc = np.zeros((4, codes.shape[0]), dtype=np.float32)
        for b in range(nb):
            acc[b % 4] = fma32(s[:, b], dots[:, b], acc[b % 4])
        out[i] = (acc[0] + acc[1]) + (acc[2] + acc[3])
    return out


def _attention_numpy(q, k_cache, v_cache, positions, window, scale, out, tree_start=-1, ancestors=None):
    for i, pos in enumerate(positions.tolist()):
        lo = max(0, pos - window + 1) if window > 0 else 0
        if ancestors is None:
            slots = np.arange(lo, pos + 1)
        else:  # the cached run before the step, then the row's ancestors (the k-th set bit: depth k)
            bits = int(ancestors[i]) & (2**64 - 1)
            path = [tree_start + j for j in range(64) if bits >> j & 1]
            slots = np.array(list(range(lo, tree_start)) + [s for d, s in enumerate(path) if tree_start + d >= lo],
                             dtype=np.int64)
        keys, values = k_cache[slots].astype(np.float32), v_cache[slots].astype(np.float32)
        for h in range(q.shape[1]):
            s = (keys @ q[i, h]) * np.float32(scale)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ values
    return out
