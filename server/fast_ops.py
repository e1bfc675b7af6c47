"""The fast path's elementwise ops: RMSNorm, RoPE, the residual and per-layer-input norms, gelu,
masks, the masked softmax, the LM head's soft cap, and the eager attention.

Contract: each op computes what transformers' Gemma 4 modules compute (RMSNorm in fp32: x *
(mean(x^2) + eps)^-0.5 * w; gelu tanh; fp32 softmax). `_EAGER_OPS` holds them as written;
`compile_ops()` / `_compiled_ops()` (the process's one compiled set) hold them torch.compile'd with
the settings that keep every step's rows on one compiled kernel per op (see `compile_ops`), which
`FastTarget` (server/fast_path.py) uses on CUDA. The `_summed_*` ops read a split-K matmul's K
slices' partials and sum them inside their own kernel (server/small_m_matmul.py `slices`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from server.small_m_matmul import round_to_bfloat16, sum_slices

# Written as transformers' Gemma 4 modules compute them (RMSNorm in fp32: x * (mean(x^2) + eps)^-0.5 * w;
# gelu tanh; fp32 softmax). On CUDA each is torch.compile'd: a fused kernel instead of 5-10 small ones,
# which matters because a graph replay still pays a few microseconds a kernel (E4B: ~40 layers).

def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    n = xf * _inv_rms(xf, eps)
    if w is not None:
        n = n * w.float()
    return n.to(x.dtype)


def _inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's scale of each row of fp32 `xf` (its last axis): (mean(x^2) + eps)^-1/2."""
    return torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)


def _norm_rope(x, w, eps, cos, sin):
    return _rope(_rms(x, w, eps), cos, sin)


def _residual_norm(residual, y, w, eps, scalar):
    h = residual + _rms(y, w, eps)
    return h * scalar if scalar is not None else h


def _residual_norm_rms(residual, y, w, eps, scalar, w_next, eps_next):
    """_residual_norm, and the next RMSNorm of its result: one kernel where there were two."""
    h = _residual_norm(residual, y, w, eps, scalar)
    return h, _rms(h, w_next, eps_next)


def _qkv_norm_rope(q, k, v, wq, eps_q, wk, eps_k, wv, eps_v, cos, sin):
    """A KV-owning layer's q and k normed and rotated, v normed: one kernel where there were three."""
    return _norm_rope(q, wq, eps_q, cos, sin), _norm_rope(k, wk, eps_k, cos, sin), _rms(v, wv, eps_v)


def _gelu_mul(g, u):
    return F.gelu(g, approximate="tanh") * u


# The same ops reading a split-K matmul's output as its K slices' partials [S, ...] (SmallMLinear.slices):
# summed in slice order and rounded once to bf16 (sum_slices), inside the op's kernel, then the op
# itself. Each is one compiled kernel for every step size, as the others are (one per slice count,
# which a linear's shape fixes), so a row's bits never depend on the step's other rows. They are
# not bit for bit the ops on a stored sum: inductor decides anew which values of the fused op to
# keep in bf16 (tests/test_summed_ops.py).

def _summed_norm_rope(pq, dtype, w, eps, cos, sin):
    """_norm_rope on the partials' rounded sum, its rotated half read from the partials themselves.
    Why: RoPE reads the normed row at other columns (`_rope`'s rotate-half); of a sum computed in
    the kernel (through sum_slices' integer rounding) inductor made that a second kernel reading
    the normed values back, one more launch per q and k a layer (E4B: 66 a step, on the H200). The sum of
    the rotated partials is the rotated sum bit for bit (negation is exact and rounding symmetric),
    the norm's scale is the row's one reduction, and each normed value is rounded to `dtype` as a
    stored one would be; so these are the bits of _norm_rope on the stored sum, every value a load
    or a same-column product, in one kernel."""
    half = pq.shape[-1] // 2
    y = sum_slices(pq, dtype)
    y_rot = sum_slices(torch.cat((-pq[..., half:], pq[..., :half]), dim=-1), dtype)
    yf = y.float()
    inv = _inv_rms(yf, eps)  # _rms's scale of the sum, for both halves
    n, n_rot = yf * inv, y_rot.float() * inv
    if w is not None:
        wf = w.float()
        n, n_rot = n * wf, n_rot * torch.cat((wf[half:], wf[:half]))
    if dtype == torch.bfloat16:  # the rounding a store to bf16 makes (inductor elides a plain .to's)
        n, n_rot = round_to_bfloat16(n), round_to_bfloat16(n_rot)
    return (n.to(dtype) * cos + n_rot.to(dtype) * sin).to(dtype)


def _summed_qkv_norm_rope(pq, pk, pv, dtype, wq, eps_q, wk, eps_k, wv, eps_v, cos, sin):
    return (_summed_norm_rope(pq, dtype, wq, eps_q, cos, sin), _summed_norm_rope(pk, dtype, wk, eps_k, cos, sin),
            _rms(sum_slices(pv, dtype), wv, eps_v))


def _summed_residual_norm(residual, p, w, eps, scalar):
    return _residual_norm(residual, sum_slices(p, residual.dtype), w, eps, scalar)


def _summed_residual_norm_rms(residual, p, w, eps, scalar, w_next, eps_next):
    return _residual_norm_rms(residual, sum_slices(p, residual.dtype), w, eps, scalar, w_next, eps_next)


def _summed_ple_inputs(p, proj_scale, w, eps, tok, input_scale):
    return _ple_inputs(sum_slices(p, tok.dtype), proj_scale, w, eps, tok, input_scale)


def _ple_inputs(proj, proj_scale, w, eps, tok, input_scale):
    return (_rms(proj * proj_scale, w, eps) + tok) * input_scale


def _masks(slot_pos, full_pos, pos, window: int):
    q = pos[:, None]
    sp = slot_pos[None, :]
    return (sp <= q) & (sp > q - window) & (sp >= 0), full_pos[None, :] <= q


def _step_masks(slot_pos, full_pos, pos, anc, window: int):
    """A step's masks, chain or tree (anc: bit j of anc[t] = row j is t or an ancestor). Row j of
    the step wrote at slot pos[0] + j (ring slot_pos records pos[0] + j), row t sits at pos[t].
    For a chain (pos consecutive, anc = rows 0..t) these are exactly `_masks`."""
    T = pos.shape[0]
    start = pos[:1]
    q = pos[:, None]
    kp = slot_pos[None, :]
    own = (kp >= start) & (kp < start + T)
    j = (kp - start).clamp(0, T - 1)
    bit = ((anc[:, None] >> j) & 1) != 0
    sliding = torch.where(own, bit & (pos[j] > q - window), (kp < start) & (kp > q - window) & (kp >= 0))
    fp = full_pos[None, :]
    jf = (fp - start).clamp(0, T - 1)
    full = (fp < start) | ((fp < start + T) & (((anc[:, None] >> jf) & 1) != 0))
    return sliding, full


def _masked_softmax(scores, mask, scaling: float):
    if scaling != 1.0:
        scores = scores * scaling
    return torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(scores.dtype)


def _softcap(logits, cap: float):
    return torch.tanh(logits / cap) * cap


class _Ops:
    def __init__(self, wrap):
        self.rms, self.norm_rope, self.residual_norm = wrap(_rms), wrap(_norm_rope), wrap(_residual_norm)
        self.residual_norm_rms, self.qkv_norm_rope = wrap(_residual_norm_rms), wrap(_qkv_norm_rope)
        self.gelu_mul, self.ple_inputs, self.masks = wrap(_gelu_mul), wrap(_ple_inputs), wrap(_masks)
        self.step_masks = wrap(_step_masks)
        self.summed_norm_rope, self.summed_qkv_norm_rope = wrap(_summed_norm_rope), wrap(_summed_qkv_norm_rope)
        self.summed_residual_norm, self.summed_residual_norm_rms = wrap(_summed_residual_norm), wrap(_summed_residual_norm_rms)
        self.summed_ple_inputs = wrap(_summed_ple_inputs)
        self.masked_softmax, self.softcap = wrap(_masked_softmax), wrap(_softcap)


_EAGER_OPS = _Ops(lambda f: f)
_COMPILED: list[_Ops] = []


def _compiled_ops() -> _Ops:
    if not _COMPILED:
        _COMPILED.append(compile_ops())
    return _COMPILED[0]


def compile_ops(backend="inductor") -> _Ops:
    """The elementwise ops torch.compile'd (dynamic row counts) with the settings that keep every
    step's rows on one compiled kernel per op, whatever the step's bucket. `backend`: tests count
    compilations with one of their own.

    Why the settings: an op is compiled again for inputs its guards reject, and two compilations
    are two kernels whose fp32 sums may round differently; a row then gets other bits in a step of
    another size, and drafted output leaves plain output. Measured on the H200 (E4B shape): by
    duck sizing, a 2-row step's row count was taken for the same symbol as the 2 KV heads, so
    bucket-2 steps (plain decoding) ran their own qkv-norm kernel, and a conversation's drafted
    tokens left its plain ones after 69 tokens in one process and not in another (each kernel's
    launch configuration had been picked by timing). Duck sizing off: the row count is its own
    symbol, one kernel for 2..64 rows. Inductor's deterministic mode (where this torch has it: 2.11
    on the GPU machine; without it, a warning): reduction kernels' configurations, which set the
    order of their sums, picked without timing, so the kernels, and the outputs, are the same in
    every process. Both settings are the process's, as the H200 runs measured them."""
    import torch._dynamo
    import torch._inductor.config
    import torch.fx.experimental._config

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch.fx.experimental._config.use_duck_shape = False
    from server.small_m_matmul import pdl_launch
    if (hasattr(torch._inductor.config.triton, "enable_pdl") and torch.cuda.is_available()
            and pdl_launch(torch.device("cuda"))):
        # The compiled ops join the step kernels' programmatic dependent launch (each waits for the
        # kernel before it, then lets the next one launch): the launch gaps between them overlap.
        torch._inductor.config.triton.enable_pdl = True
    if hasattr(torch._inductor.config, "deterministic"):
        torch._inductor.config.deterministic = True
    else:
        import warnings
        warnings.warn(f"torch {torch.__version__} has no inductor deterministic mode: compiled kernels' launch "
                      "configurations are picked by timing, so outputs may differ between processes")
    return _Ops(lambda f: torch.compile(f, fullgraph=True, dynamic=True, backend=backend))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
               masked_softmax) -> torch.Tensor:
    """q [T, H, D]; k, v [KVH, S, D]; mask [T, S] (True = visible). Query head h reads KV head
    h // (H / KVH), as transformers' repeat_kv. Softmax in fp32, as transformers' eager attention."""
    T, H, D = q.shape
    kvh = k.shape[0]
    g = H // kvh
    qg = q.view(T, kvh, g, D).permute(1, 2, 0, 3).reshape(kvh, g * T, D)
    scores = torch.bmm(qg, k.transpose(1, 2)).view(kvh, g, T, -1)
    probs = masked_softmax(scores, mask, scaling)
    out = torch.bmm(probs.view(kvh, g * T, -1), v).view(kvh, g, T, D)
    return out.permute(2, 0, 1, 3).reshape(T, H * D)
