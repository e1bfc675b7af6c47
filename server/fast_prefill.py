"""Prefill for the fast path (server/fast_path.py): layer by layer over all new tokens, at GEMM speed.

Contract: `prefill_layers(fast, ids, start, checkpoint)` runs tokens `ids` at positions
start..start+T-1 through `fast`'s model, writes their K/V into its static cache (full layers: slot =
position; sliding layers: the last `ring` positions into the ring), calls `checkpoint(c, rows)` for
every position c in (start, start+T] that is a multiple of `fast.checkpoint_every` with the sliding
layers' K/V of positions c-window..c-1 (so a later request can resume at c exactly), and returns the
last token's logits [vocab]. The cache must already hold positions 0..start-1, the sliding layers'
last window of them in the ring (the caller's invariant, see server/fast_prefix.py).

Why layer by layer: each layer's weights are turned into one dense bf16 matrix once per call
(int4 codes dequantized by a compiled kernel) and multiplied with every new row in big cuBLAS
GEMMs, instead of tinygemm's small-row int4 kernel chunk after chunk; and the KV-shared layers
(Gemma 4: the last 18 of 42), which write no cache, run for the last token only (as transformers
does with logits_to_keep). Attention goes through PyTorch's scaled_dot_product_attention in query
blocks, keys cut to the blocks' reach (the window on sliding layers), so no [T, T] score matrix is
ever built for a long prompt.

Numerics: the same math as the step forward (RMSNorm in fp32, the same RoPE tables, fp32 softmax
inside SDPA), but other kernels, so a token's K/V from a prefill and from a step agree to rounding,
not bit for bit; tests measure how often that changes a greedy token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_BLOCK = 8192           # rows per GEMM (bounds the MLP's activations)
SCORE_BUDGET = 1 << 28     # query rows x keys x heads per attention block (math fallback: 1 GiB fp32)


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
        proj = _rows(fast.ple_model_proj, h).reshape(T, fast.n_layers, fast.ple_dim)
        ple = ops.ple_inputs(proj, fast.ple_model_proj_scale, _w(fast.ple_norm), fast.ple_norm.eps, tok,
                             fast.ple_input_scale)
    rope = {s: (c.index_select(0, pos)[:, None, :], n.index_select(0, pos)[:, None, :]) for s, (c, n) in fast.rope.items()}
    sources: dict[int, tuple] = {}   # source layer -> (k, v, key positions) for its readers
    first_shared = next((layer.index for layer in fast.layers if layer.source != layer.index), fast.n_layers)
    for layer in fast.layers:
        if layer.index == first_shared:  # KV-shared layers write nothing: only the last row matters
            h, pos, ple = h[-1:], pos[-1:], (ple[-1:] if ple is not None else None)
            rope = {s: (c[-1:], n[-1:]) for s, (c, n) in rope.items()}
        h = _layer(fast, layer, h, pos, ple, rope[layer.sliding], sources, start, end, checkpoint)
    x = ops.rms(h[-1:], _w(fast.final_norm), fast.final_norm.eps)
    logits = _rows(fast.lm_head, x)
    return (ops.softcap(logits, fast.softcap) if fast.softcap else logits)[0]


def _layer(fast, layer, h, pos, ple, cos_sin, sources, start, end, checkpoint):
    ops, hf = fast.ops, layer.hf
    attn = hf.self_attn
    T, D = h.shape[0], layer.head_dim
    cos, sin = cos_sin
    x = ops.rms(h, _w(hf.input_layernorm), hf.input_layernorm.eps)
    lin = layer.step if layer.step is not None else layer
    owns = layer.source == layer.index
    if lin.qkv is not None and owns:
        q_raw, k_raw, *v_raw = _rows(lin.qkv, x).split(lin.qkv_sizes, -1)
        v_raw = v_raw[0] if v_raw else k_raw
    else:
        q_raw = _rows(lin.qkv, x).split(lin.qkv_sizes, -1)[0] if lin.qkv is not None else _rows(lin.q, x)
        if owns:
            k_raw = _rows(lin.k, x)
            v_raw = _rows(lin.v, x) if lin.v is not None else k_raw
    q = ops.norm_rope(q_raw.view(T, fast.num_heads, D), _w(attn.q_norm), attn.q_norm.eps, cos, sin)
    if owns:
        k = ops.norm_rope(k_raw.view(T, layer.kv_heads, D), _w(attn.k_norm), attn.k_norm.eps, cos, sin)
        v = ops.rms(v_raw.view(T, layer.kv_heads, D), _w(attn.v_norm), attn.v_norm.eps)
        sources[layer.index] = _store_kv(fast, layer, k.transpose(0, 1), v.transpose(0, 1), start, end, checkpoint)
    keys, values, kpos = sources[layer.source]
    a = _attend(q, keys, values, kpos, pos, fast.window if layer.sliding else None, attn.scaling)
    h = ops.residual_norm(h, _rows(lin.o, a), _w(hf.post_attention_layernorm), hf.post_attention_layernorm.eps, None)
    x = ops.rms(h, _w(hf.pre_feedforward_layernorm), hf.pre_feedforward_layernorm.eps)
    x = _mlp(fast, lin, x)
    scalar = getattr(hf, "layer_scalar", None)
    last = not fast.ple_dim
    h = ops.residual_norm(h, x, _w(hf.post_feedforward_layernorm), hf.post_feedforward_layernorm.eps,
                          scalar if last else None)
    if fast.ple_dim:
        x = _rows(lin.ple_proj, ops.gelu_mul(_rows(lin.ple_gate, h), ple[:, layer.index]))
        h = ops.residual_norm(h, x, _w(hf.post_per_layer_input_norm), hf.post_per_layer_input_norm.eps, scalar)
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
        return kc[:, :end], vc[:, :end], torch.arange(end, device=dev)
    # Sliding: the window before `start` comes from the ring, then the new rows.
    lo = max(0, start - fast.window + 1)
    past = torch.arange(lo, start, device=dev)
    keys = torch.cat([kc.index_select(1, past % fast.ring), k], 1)
    values = torch.cat([vc.index_select(1, past % fast.ring), v], 1)
    kpos = torch.arange(lo, end, device=dev)
    keep = torch.arange(max(start, end - fast.ring), end, device=dev)
    kc.index_copy_(1, keep % fast.ring, keys[:, keep - lo])
    vc.index_copy_(1, keep % fast.ring, values[:, keep - lo])
    if layer.index == fast.first_sliding_source:
        fast.slot_pos.index_copy_(0, keep % fast.ring, keep)
    every = fast.checkpoint_every
    for c in range((start // every + 1) * every, end + 1, every):
        rows = torch.arange(max(0, c - fast.window), c, device=dev) - lo
        if rows.numel() and rows[0] >= 0:
            checkpoint(c, layer.index, keys[:, rows], values[:, rows])
    return keys, values, kpos


def _attend(q, keys, values, kpos, qpos, window, scaling):
    """softmax(q k^T * scaling) v over keys at positions <= the query's (and > query - window).
    q [T, H, D]; keys, values [KVH, S, D] at positions kpos (consecutive). Query head h reads KV
    head h // (H / KVH), as transformers' repeat_kv: the heads of one KV head are folded into the
    query rows, so the keys are never repeated."""
    T, H, D = q.shape
    kvh, S = keys.shape[0], keys.shape[1]
    g = H // kvh
    block = max(64, min(4096, SCORE_BUDGET // max(1, H * S)))
    out = torch.empty((kvh, g, T, D), dtype=q.dtype, device=q.device)
    qg = q.view(T, kvh, g, D).permute(1, 2, 0, 3)                             # [KVH, g, T, D]
    k0 = int(kpos[0])
    qlo = int(qpos[0])
    for r in range(0, T, block):
        t = min(block, T - r)
        first, last = qlo + r, qlo + r + t - 1          # positions are consecutive
        hi = last - k0 + 1                               # keys past the block's last query: never visible
        lo = max(0, first - k0 - window + 1) if window else 0
        kp = kpos[lo:hi]
        qp = qpos[r:r + t]
        mask = kp[None, :] <= qp[:, None]
        if window:
            mask &= kp[None, :] > qp[:, None] - window
        qb = qg[:, :, r:r + t].reshape(1, kvh, g * t, D)
        o = F.scaled_dot_product_attention(qb, keys[None, :, lo:hi], values[None, :, lo:hi],
                                           attn_mask=mask.repeat(g, 1)[None, None], scale=scaling)
        out[:, :, r:r + t] = o.view(kvh, g, t, D)
    return out.permute(2, 0, 1, 3).reshape(T, H * D)


def _rows(lin, x: torch.Tensor) -> torch.Tensor:
    """lin(x) for many rows: one dense GEMM on the layer's weight, dequantized for this call."""
    if getattr(lin, "int4", False):      # a step-kernel SmallMLinear on int4 codes: W^T [K, N] once
        return x @ _dequant()(lin.weight, lin.scale, lin.offset)
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


def _w(norm) -> torch.Tensor | None:
    return norm.weight if getattr(norm, "with_scale", True) and getattr(norm, "weight", None) is not None else None
