"""Gemma 3 text models on the CPU without transformers: int8 weights, a static KV cache, and
batch-invariant kernels, so a drafted verify step gives the very logits one-token steps give.

Contract: `CpuGemma3.from_hf(model)` takes a loaded transformers `Gemma3ForCausalLM` (the bundled
model is the GGUF dequantized to fp32) and re-lays its weights out once: every linear as int8 codes
with one fp32 scale per 32 input features (llama.cpp's Q8_0 layout; a Q8_0 GGUF tensor, such as the
bundled model's embedding / LM head, comes back exactly), q/k/v fused into one matrix and gate/up
into another. `forward(ids, start, cache) -> logits [len(ids), vocab]` (float32) runs ids at
positions start.. of `cache` (a `KVCache`), writing their keys and values there; it reads positions
< start + len(ids). `last_only=True` returns only the last row's logits [1, vocab] (a prefill). Arithmetic: activations are quantized per row and 32-value block to int8 (Q8_0),
dot products are exact int32 per block, scaled and summed in fp32 in block order
(server/_cpu_kernels.c); norms, RoPE and the activation run in float32 numpy, row by row
independent. Invariant: row i of the logits depends only on the ids and cache before it, not on how
many rows the call carries or how many threads run it (tests/test_cpu_model.py checks it bit for bit).

The math is transformers' Gemma 3 (Gemma3RMSNorm's x * rsqrt(mean(x^2) + eps) * (1 + w) in float32,
scaled embeddings, q/k norms, NeoX RoPE with the local and global bases, the 512-token sliding window
(a key at p is seen from q if q - window < p <= q), query_pre_attn_scalar ** -0.5, gelu-tanh
gate times up), in int8 where transformers runs fp32: logits agree closely, not exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # input features per int8 scale


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [N, K] -> (int8 codes [N, K], fp32 scales [N, K/32]): per 32-value block, scale =
    max|w| / 127 and codes = round-half-even(w / scale) (Q8_0's rule)."""
    from server import cpu_kernels

    if cpu_kernels.AVAILABLE:  # the activations' kernel applies the same rule, in C
        return cpu_kernels.quantize_rows(np.ascontiguousarray(w, dtype=np.float32))
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=2)
    scale = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(blocks / safe[:, :, None]), -127, 127).astype(np.int8)
    return codes.reshape(n, k), scale


@dataclass
class Int8Linear:
    codes: np.ndarray   # int8 [N, K]
    scales: np.ndarray  # fp32 [N, K / 32]

    @classmethod
    def of(cls, *weights: np.ndarray) -> "Int8Linear":
        """One linear computing the given weights' outputs side by side (fused)."""
        codes, scales = quantize_weight(np.concatenate(weights, axis=0))
        return cls(np.ascontiguousarray(codes), np.ascontiguousarray(scales))

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


class KVCache:
    """Keys and values of every layer, [layers, max_len, head_dim] float32 each (one KV head)."""

    def __init__(self, layers: int, max_len: int, head_dim: int):
        self.k = np.zeros((layers, max_len, head_dim), dtype=np.float32)
        self.v = np.zeros((layers, max_len, head_dim), dtype=np.float32)
        self.max_len = max_len


def unsupported_reason(model) -> str | None:
    """None when `CpuGemma3.from_hf(model)` serves this model, else why not (the eager path serves it)."""
    c = model.config
    if getattr(c, "model_type", None) not in ("gemma3_text",) or not hasattr(model, "model"):
        return f"takes Gemma 3 text models (this one is {getattr(c, 'model_type', type(model).__name__)})"
    if c.num_key_value_heads != 1:
        return f"takes one KV head (this model has {c.num_key_value_heads})"
    if getattr(c, "attn_logit_softcapping", None) or getattr(c, "final_logit_softcapping", None):
        return "does not implement logit soft-capping"
    if not getattr(c, "tie_word_embeddings", True):
        return "takes tied embeddings (the LM head is the embedding table)"
    widths = (c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)
    if any(w % BLOCK for w in widths):
        return f"needs widths that are multiples of {BLOCK} (hidden, attention and MLP widths {widths})"
    if any(getattr(c, "rope_parameters", {}).get(t, {}).get("rope_type", "default") != "default"
           for t in set(c.layer_types)):
        return "implements default RoPE only (this model scales it)"
    return None


class CpuGemma3:
    def __init__(self, cfg: dict, embed: Int8Linear, layers: list[dict], final_norm: np.ndarray, kernels):
        self.cfg = cfg
        self.embed = embed  # also the LM head (tied)
        self.layers = layers
        self.final_norm = final_norm
        self.k = kernels
        self.hidden, self.heads, self.head_dim = cfg["hidden"], cfg["heads"], cfg["head_dim"]
        self.eps = np.float32(cfg["eps"])
        self.embed_scale = np.float32(cfg["hidden"] ** 0.5)
        self.scale = float(cfg["query_pre_attn_scalar"] ** -0.5)
        self.window = cfg["window"]
        self._rope = {theta: _inv_freq(theta, self.head_dim) for theta in {l["theta"] for l in layers}}

    @classmethod
    def from_hf(cls, model, kernels=None) -> "CpuGemma3":
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the CPU int8 path {reason}")
        c = model.config
        m = model.model
        arr = lambda t: t.detach().float().cpu().numpy()
        norm = lambda mod: (1.0 + arr(mod.weight)).astype(np.float32)  # Gemma3RMSNorm's (1 + w), once
        rope = c.rope_parameters
        layers = []
        for i, layer in enumerate(m.layers):
            a, mlp = layer.self_attn, layer.mlp
            kind = c.layer_types[i]
            layers.append({
                "sliding": kind == "sliding_attention",
                "theta": float(rope[kind]["rope_theta"]),
                "qkv": Int8Linear.of(arr(a.q_proj.weight), arr(a.k_proj.weight), arr(a.v_proj.weight)),
                "o": Int8Linear.of(arr(a.o_proj.weight)),
                "gate_up": Int8Linear.of(arr(mlp.gate_proj.weight), arr(mlp.up_proj.weight)),
                "down": Int8Linear.of(arr(mlp.down_proj.weight)),
                "in_norm": norm(layer.input_layernorm), "post_attn_norm": norm(layer.post_attention_layernorm),
                "pre_ffn_norm": norm(layer.pre_feedforward_layernorm), "post_ffn_norm": norm(layer.post_feedforward_layernorm),
                "q_norm": norm(a.q_norm), "k_norm": norm(a.k_norm),
            })
        cfg = {"hidden": c.hidden_size, "heads": c.num_attention_heads, "head_dim": c.head_dim,
               "intermediate": c.intermediate_size, "vocab": c.vocab_size, "eps": c.rms_norm_eps,
               "query_pre_attn_scalar": c.query_pre_attn_scalar, "window": c.sliding_window,
               "layers": len(layers)}
        if kernels is None:
            from server import cpu_kernels as kernels
        return cls(cfg, Int8Linear.of(arr(m.embed_tokens.weight)), layers, norm(m.norm), kernels)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(len(self.layers), max_len, self.head_dim)

    def nbytes(self) -> int:
        return self.embed.nbytes() + sum(l[n].nbytes() for l in self.layers for n in ("qkv", "o", "gate_up", "down"))

    def forward(self, ids, start: int, cache: KVCache, last_only: bool = False) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        m = ids.shape[0]
        if start + m > cache.max_len:
            raise ValueError(f"positions {start}..{start + m - 1} exceed the cache's {cache.max_len}")
        positions = np.arange(start, start + m, dtype=np.int64)
        k, heads, d = self.k, self.heads, self.head_dim
        x = self._embed_rows(ids)
        q_width = heads * d
        for i, L in enumerate(self.layers):
            h = self._norm(x, L["in_norm"])
            qkv = k.linear(h, L["qkv"])
            q = self._norm(qkv[:, :q_width].reshape(m, heads, d), L["q_norm"])
            key = self._norm(qkv[:, q_width : q_width + d], L["k_norm"])
            cos, sin = self._cos_sin(positions, L["theta"])
            q = _rope(q, cos[:, None, :], sin[:, None, :])
            cache.k[i, start : start + m] = _rope(key, cos, sin)
            cache.v[i, start : start + m] = qkv[:, q_width + d :]
            attn = k.attention(np.ascontiguousarray(q), cache.k[i], cache.v[i], positions,
                               self.window if L["sliding"] else 0, self.scale)
            x = x + self._norm(k.linear(attn.reshape(m, q_width), L["o"]), L["post_attn_norm"])
            gate_up = k.linear(self._norm(x, L["pre_ffn_norm"]), L["gate_up"])
            inter = gate_up.shape[1] // 2
            act = _gelu_tanh(gate_up[:, :inter]) * gate_up[:, inter:]
            x = x + self._norm(k.linear(np.ascontiguousarray(act), L["down"]), L["post_ffn_norm"])
        if last_only:  # a prefill chunk: only its last row's logits are read (the LM head is most of the work)
            x = x[-1:]
        return k.linear(self._norm(x, self.final_norm), self.embed)

    def _embed_rows(self, ids: np.ndarray) -> np.ndarray:
        e = self.embed
        rows = e.codes[ids].astype(np.float32).reshape(len(ids), -1, BLOCK) * e.scales[ids][:, :, None]
        return rows.reshape(len(ids), -1) * self.embed_scale

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """Gemma3RMSNorm over the last axis, float32, each row on its own."""
        var = np.einsum("...i,...i->...", x, x, dtype=np.float32) / np.float32(x.shape[-1])
        return x * (1.0 / np.sqrt(var + self.eps))[..., None].astype(np.float32) * weight

    def _cos_sin(self, positions: np.ndarray, theta: float) -> tuple[np.ndarray, np.ndarray]:
        freqs = positions.astype(np.float32)[:, None] * self._rope[theta][None, :]
        emb = np.concatenate([freqs, freqs], axis=1)
        return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _inv_freq(theta: float, dim: int) -> np.ndarray:
    """transformers' default RoPE inverse frequencies, in float32 as it computes them."""
    import torch

    return (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).numpy()


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(np.float32)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return (np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))).astype(np.float32)
