"""Prefill for the fast path (server/fast_path.py): layer by layer over all new tokens, at GEMM speed.

Contract: `prefill_layers(fast, ids, start, checkpoint)` runs tokens `ids` at positions
start..start+T-1 through `fast`'s model, writes their K/V into its static cache (full layers: slot =
position; sliding layers: the last `ring` positions into the ring), calls `checkpoint(c, rows)` for
every position c in (start, start+T] that is a multiple of `fast.checkpoint_every` with the sliding
layers' K/V of positions c-window..c-1 (so a later request can resume at c exactly), and returns the
last token's logits [vocab]. The cache must already hold positions 0..start-1, the sliding layers'
last window of them in the ring (the caller's invariant, see server/fast_prefix.py).

Why layer by layer: every layer's int4 weights meet all new rows in big cuBLAS GEMMs on a dense
bf16 W^T, read from the step kernels' int4 layout (the only copy of the weights on the GPU): each
linear is dequantized by one Triton launch into a bf16 scratch shared by all linears (the size of
the largest), or, where memory is plentiful, a dense W^T is kept for each (`keep_dense_weights`;
bit for bit the same W^T), instead of tinygemm's small-row int4 kernel chunk after chunk; and the
KV-shared layers (Gemma 4: the last 18 of 42), which write no cache, run for the last token only
(as transformers does with logits_to_keep). Attention is the step forward's math (bf16 products,
fp32 masked softmax) in query blocks that read only the keys they can see (the window on sliding
layers), so no [T, T] score matrix is ever built; SDPA's kernels were slower here (its memory-
efficient kernel at head_dim 512, cuDNN's per-shape plans). No device-to-host syncs: positions
are host integers.

Numerics: the same math as the step forward (RMSNorm in fp32, the same RoPE tables, fp32 softmax),
but other kernels, so a token's K/V from a prefill and from a step agree to rounding, not bit for
bit; tests measure how often that changes a greedy token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from server.small_m_matmul import triton_available

ROW_BLOCK = 8192           # rows per GEMM (bounds the MLP's activations)
SCORE_BUDGET = 1 << 28     # query rows x keys x heads per attention block, at most (bf16 scores: 512 MiB)


def score_budget(rows: int) -> int:
    """Attention scores per block for prefill pieces of `rows` tokens (FastTarget.prefill_rows): the
    scores and probabilities (bf16) then take about as much memory as the piece's other activations
    (8192 rows: 2^27 entries, 256 MiB each; 2048 rows: 64 MiB)."""
    return max(1 << 22, min(SCORE_BUDGET, rows << 14))


def prefill_layers(fast, ids: list[int], start: int, checkpoint) -> torch.Tensor:
    ops, dev = fast.ops, fast.device
    T = len(ids)
    end = start + T
    ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
    pos = torch.arange(start, end, device=dev)
    h = fast.embed(ids_t)                                                        # [T, hidden]
    ple = None
    if fast.ple_dim:
        tok = fast.embed_ple(ids_t).reshape(T, fast.n_layers, fast.ple_dim)
        proj_lin = fast.ple_model_proj_step if fast.step_kernels else fast.ple_model_proj
        proj = _rows(proj_lin, h).reshape(T, fast.n_layers, fast.ple_dim)
        ple = ops.ple_inputs(proj, fast.ple_model_proj_scale, _w(fast.ple_norm), _eps(fast.ple_norm), tok,
                             fast.ple_input_scale)
        del tok, proj  # [T, layers x ple_dim] each (E4B: 21 KiB a token): not kept through the layers
    rope = fast.rope_rows(pos)
    sources: dict[int, tuple] = {}   # source layer -> (k, v, position of the first key) for its readers
    first_shared = next((layer.index for layer in fast.layers if layer.source != layer.index), fast.n_layers)
    q0 = start                       # position of the first query row (host-side: no device syncs)
    for layer in fast.layers:
        if layer.index == first_shared:  # KV-shared layers write nothing: only the last row matters
            h, ple, q0 = h[-1:], (ple[-1:] if ple is not None else None), end - 1
            rope = {s: (c[-1:], n[-1:]) for s, (c, n) in rope.items()}
        h = _layer(fast, layer, h, q0, ple, rope[layer.sliding], sources, start, end, checkpoint)
    x = ops.rms(h[-1:], _w(fast.final_norm), _eps(fast.final_norm))
    logits = _rows(fast.lm_head, x)
    return (ops.softcap(logits, fast.softcap) if fast.softcap else logits)[0]


def _layer(fast, layer, h, q0, ple, cos_sin, sources, start, end, checkpoint):
    ops, hf = fast.ops, layer.hf
    attn = hf.self_attn
    T, D = h.shape[0], layer.head_dim
    cos, sin = cos_sin
    x = ops.rms(h, _w(hf.input_layernorm), _eps(hf.input_layernorm))
    lin = layer.step if layer.step is not None else layer
    owns = layer.source == layer.index
    if lin.qkv is not None:  # fused only where the layer owns k (and v)
        q_raw, k_raw, *v_raw = _rows(lin.qkv, x).split(lin.qkv_sizes, -1)
        v_raw = v_raw[0] if v_raw else k_raw
    else:
        q_raw = _rows(lin.q, x)
        if owns:
            k_raw = _rows(lin.k, x)
            v_raw = _rows(lin.v, x) if lin.v is not None else k_raw
    q = ops.norm_rope(q_raw.view(T, fast.num_heads, D), _w(attn.q_norm), _eps(attn.q_norm), cos, sin)
    if owns:
        k = ops.norm_rope(k_raw.view(T, layer.kv_heads, D), _w(attn.k_norm), _eps(attn.k_norm), cos, sin)
        v = ops.rms(v_raw.view(T, layer.kv_heads, D), _w(attn.v_norm), _eps(attn.v_norm))
        sources[layer.index] = _store_kv(fast, layer, k.transpose(0, 1), v.transpose(0, 1), start, end, checkpoint)
    keys, values, k0 = sources[layer.source]
    a = _attend(ops, q, keys, values, k0, q0, fast.window if layer.sliding else None, attn.scaling,
                getattr(fast, "score_budget", SCORE_BUDGET))
    h = ops.residual_norm(h, _rows(lin.o, a), _w(hf.post_attention_layernorm), _eps(hf.post_attention_layernorm), None)
    x = ops.rms(h, _w(hf.pre_feedforward_layernorm), _eps(hf.pre_feedforward_layernorm))
    x = _mlp(fast, lin, x)
    scalar = getattr(hf, "layer_scalar", None)
    last = not fast.ple_dim
    h = ops.residual_norm(h, x, _w(hf.post_feedforward_layernorm), _eps(hf.post_feedforward_layernorm),
                          scalar if last else None)
    if fast.ple_dim:
        x = _rows(lin.ple_proj, ops.gelu_mul(_rows(lin.ple_gate, h), ple[:, layer.index]))
        h = ops.residual_norm(h, x, _w(hf.post_per_layer_input_norm), _eps(hf.post_per_layer_input_norm), scalar)
    return h


def _mlp(fast, lin, x):
    out = []
    for r in range(0, x.shape[0], ROW_BLOCK):
        xr = x[r:r + ROW_BLOCK]
        if lin.gate_up is not None:
            g, u = _rows(lin.gate_up, xr).split((lin.gate.out_features, lin.up.out_features), -1)
        else:
            g, u = _rows(lin.gate, xr), _rows(lin.up, xr)
        out.append(_rows(lin.down, fast.ops.gelu_mul(g, u)))
    return out[0] if len(out) == 1 else torch.cat(out)


def _store_kv(fast, layer, k, v, start, end, checkpoint):
    """Write a source layer's new K/V [KVH, T, D] into the cache; return what its readers attend to."""
    kc, vc = fast.k_cache[layer.index], fast.v_cache[layer.index]
    dev = k.device
    if not layer.sliding:
        kc[:, start:end].copy_(k)
        vc[:, start:end].copy_(v)
        return kc[:, :end], vc[:, :end], 0
    # Sliding: the window before `start` comes from the ring, then the new rows.
    lo = max(0, start - fast.window + 1)
    past = torch.arange(lo, start, device=dev)
    keys = torch.cat([kc.index_select(1, past % fast.ring), k], 1)
    values = torch.cat([vc.index_select(1, past % fast.ring), v], 1)
    keep = torch.arange(max(start, end - fast.ring), end, device=dev)
    kc.index_copy_(1, keep % fast.ring, keys[:, keep - lo])
    vc.index_copy_(1, keep % fast.ring, values[:, keep - lo])
    if layer.index == fast.first_sliding_source:
        fast.slot_pos.index_copy_(0, keep % fast.ring, keep)
    every = fast.checkpoint_every
    for c in range((start // every + 1) * every, end + 1, every):
        first = max(0, c - fast.window)   # >= lo, since c > start
        checkpoint(c, layer.index, keys[:, first - lo:c - lo], values[:, first - lo:c - lo])
    return keys, values, lo


def _attend(ops, q, keys, values, k0: int, q0: int, window, scaling, budget: int = SCORE_BUDGET,
            kernel_softmax: bool | None = None):
    """softmax(q k^T * scaling) v over the keys at positions <= the query's (and > query - window).
    q [T, H, D] at positions q0..q0+T-1; keys, values [KVH, S, D] at positions k0..k0+S-1. Query
    head h reads KV head h // (H / KVH), as transformers' repeat_kv (the heads of one KV head are
    folded into the rows, so keys are never repeated). The same products as the step forward's
    `_attention` and an fp32 masked softmax, one block of queries at a time: a block reads only the
    keys it can see, and its score matrix stays under `budget` entries. The softmax is
    `_softmax_rows`' kernel where `kernel_softmax` (default: on CUDA with Triton), else the ops'
    masked_softmax over a mask tensor."""
    T, H, D = q.shape
    kvh, S = keys.shape[0], keys.shape[1]
    g = H // kvh
    span = lambda rows: rows + window if window else S
    block = 4096
    while block > 16 and H * block * span(block) > budget:
        block //= 2
    dev = q.device
    if kernel_softmax is None:
        kernel_softmax = dev.type == "cuda" and triton_available()
    qg = q.view(T, kvh, g, D).permute(1, 2, 0, 3)                             # [KVH, g, T, D]
    out = torch.empty((kvh, g, T, D), dtype=q.dtype, device=dev)
    for r in range(0, T, block):
        t = min(block, T - r)
        first, last = q0 + r, q0 + r + t - 1
        hi = last - k0 + 1                               # keys past the block's last query: never visible
        lo = max(0, first - k0 - window + 1) if window else 0
        qb = qg[:, :, r:r + t].reshape(kvh, g * t, D)
        scores = torch.bmm(qb, keys[:, lo:hi].transpose(1, 2)).view(kvh, g, t, hi - lo)
        if kernel_softmax:
            probs = _softmax_rows(scores, t, first, k0 + lo, window, scaling)
        else:
            kp = torch.arange(k0 + lo, k0 + hi, device=dev)
            qp = torch.arange(first, last + 1, device=dev)
            mask = kp[None, :] <= qp[:, None]
            if window:
                mask &= kp[None, :] > qp[:, None] - window
            probs = ops.masked_softmax(scores, mask, scaling)
        out[:, :, r:r + t] = torch.bmm(probs.view(kvh, g * t, hi - lo), values[:, lo:hi]).view(kvh, g, t, D)
    return out.permute(2, 0, 1, 3).reshape(T, H * D)


def _softmax_rows(scores: torch.Tensor, t: int, first: int, key0: int, window, scaling: float) -> torch.Tensor:
    """The masked softmax of `_attend`'s block on the GPU, in place: scores [..., t, S] of queries
    at positions first.. against keys at key0.., by one Triton kernel that derives the causal
    (and window) mask from the positions (server/gpu_kernels.py `_prefill_softmax_kernel`).

    Why not the compiled op: inductor's deterministic mode (fast_ops.compile_ops, kept for the
    steps' batch invariance) picks a split reduction for rows of thousands of keys, and without
    its online softmax (a warning says so) a 64k-token prefill took twice as long. This kernel
    reads each row twice and writes it once, in a fixed order. It multiplies by `scaling` in fp32
    (the op multiplied the bf16 scores; Gemma 3n and 4 attend with scaling 1)."""
    from server.gpu_kernels import _prefill_softmax_kernel

    if not scores.is_contiguous():
        raise ValueError("_softmax_rows: scores must be contiguous (rows of S keys)")
    rows, S = scores.numel() // scores.shape[-1], scores.shape[-1]
    _prefill_softmax_kernel[(rows,)](scores, scores, S, t, first, key0, int(window or 0), float(scaling),
                                     BLOCK=1024, num_warps=4)
    return scores


def keep_dense_weights(fast, asked: bool | None) -> str:
    """Prefill's int4 weights: by default each linear is dequantized, when it runs, into one shared
    bf16 scratch the size of the largest (`share_prefill_scratch`), then one cuBLAS GEMM reads it. A
    dense W^T of every int4 weight is kept instead (no dequantization per call, 2 bytes a weight: 7.4
    GiB on E4B) when asked, or when `asked` is None and it takes under a quarter of free GPU memory
    (the engine decides from its memory plan, server/fast_memory.py's `plan_fast_memory`: never under
    a memory cap it does not fit). Both give the same W^T bit for bit. A note says which."""
    from server.small_m_matmul import share_prefill_scratch

    lins = [lin for lin in fast.step_linears() if getattr(lin, "int4", False)]
    if not lins:
        return "prefill: dense weights as loaded"
    need = sum(lin.n * lin.k * lin.scale.element_size() for lin in lins)
    if asked is None:
        free, _ = torch.cuda.mem_get_info(fast.device) if fast.device.type == "cuda" else (0, 0)
        asked = need < 0.25 * free
    if not asked:
        fast.prefill_scratch_bytes = share_prefill_scratch(lins)
        return (f"prefill: int4 weights dequantized per linear into a {fast.prefill_scratch_bytes / 2**20:.0f} MiB "
                f"scratch (a dense copy, {need / 2**30:.2f} GiB, not kept)")
    for lin in lins:
        lin.prefill_weight = lin.dequantize_t()
    return f"prefill: dense bf16 copy of the int4 weights kept for prefill GEMMs ({need / 2**30:.2f} GiB)"


def _rows(lin, x: torch.Tensor) -> torch.Tensor:
    """lin(x) for many rows: one dense GEMM on the layer's weight (int4: dequantized)."""
    dense = getattr(lin, "prefill_weight", None)
    if dense is not None:
        return x @ dense
    if getattr(lin, "int8", False):      # the int8 LM head (fast_path._int8_head): the step kernel, for
        return lin(x)                    # the last row (at most MAX_ROWS rows)
    if getattr(lin, "int4", False):      # a step-kernel SmallMLinear on int4 codes: W^T [K, N] per call
        scratch = getattr(lin, "prefill_scratch", None)
        if scratch is not None:
            return x @ lin.dequantize_t(scratch)
        return x @ _dequant()(lin.weight, lin.scale, lin.offset)   # no shared scratch: a new W^T each call
    if getattr(lin, "weight", None) is not None and getattr(lin, "packed", None) is None:
        return F.linear(x, lin.weight)
    # tinygemm int4 (no step kernels): its own kernel, in row blocks
    return torch.cat([lin(x[r:r + ROW_BLOCK]) for r in range(0, x.shape[0], ROW_BLOCK)])


def _dequant_codes(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """server/small_m_matmul.py's int4 layout -> W^T [K, N] (row-major, so the writes stay
    coalesced): W = code * scale + offset, in fp32, rounded once to the activations' dtype."""
    k8, n = qweight.shape
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int32) * 4
    codes = (qweight.reshape(k8 // 16, 1, 16, n) >> shifts[None, :, None, None]) & 0xF   # [group, j, r, N]
    w = codes.float() * scale.float()[:, None, None, :] + offset.float()[:, None, None, :]
    return w.to(scale.dtype).reshape(k8 * 8, n)


_DEQUANT: list = []


def _dequant():
    if not _DEQUANT:
        _DEQUANT.append(torch.compile(_dequant_codes, dynamic=True) if torch.cuda.is_available() else _dequant_codes)
    return _DEQUANT[0]


def _eps(norm) -> float:
    """A transformers RMSNorm's epsilon: `eps` up to transformers 5.24, `variance_epsilon` from 5.25."""
    eps = getattr(norm, "eps", None)
    return norm.variance_epsilon if eps is None else eps


def _w(norm) -> torch.Tensor | None:
    return norm.weight if getattr(norm, "with_scale", True) and getattr(norm, "weight", None) is not None else None
