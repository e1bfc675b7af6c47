"""Gemma 3 and Gemma 4 text models on the CPU without transformers: int8 weights, a KV cache of
its own, and batch-invariant kernels, so a drafted verify step gives the very logits one-token steps
give.

Contract: `CpuGemma.from_hf(model)` takes a loaded transformers `Gemma3ForCausalLM` or
`Gemma4ForCausalLM` (text; the bundled model is the GGUF dequantized to fp32) and re-lays its weights
out once: every linear as int8 codes with one fp32 scale per 32 input features (llama.cpp's Q8_0
layout; a Q8_0 GGUF tensor, such as the bundled model's embedding / LM head, comes back exactly), q/k/v
fused into one matrix and gate/up into another; embedding tables stay int8 too, rows dequantized as
they are looked up. `forward(ids, start, cache) -> logits [len(ids), vocab]` (float32) runs ids at
positions start.. of `cache` (a `KVCache`), writing their keys and values there; it reads positions
< start + len(ids). `last_only=True` returns only the last row's logits [1, vocab] (a prefill).
Arithmetic: activations are quantized per row and 32-value block to int8 (Q8_0), dot products are
exact int32 per block, scaled and summed in fp32 in a fixed order (server/_cpu_kernels.c); norms,
RoPE and the activations run in float32 numpy, row by row independent. Invariant: row i of the
logits depends only on the ids and cache before it, not on how many rows the call carries or how
many threads run it (tests/test_cpu_model.py checks it bit for bit).

The math is transformers': Gemma 3's RMSNorm scales by (1 + w), Gemma 4's by w (its value norm by
nothing); scaled embeddings; q/k norms; RoPE from the model's own rotary module (its local and
global bases, Gemma 4's partial rotation); the sliding window (a key at p is seen from q if
q - window < p <= q); each layer's attention scaling; gelu-tanh gate times up; and for Gemma 4 the
per-layer inputs (a per-layer embedding table plus a projection of the embeddings), KV-shared layers
that read an earlier layer's cache, the layer scalar and the final logit soft-cap. It runs in int8
where transformers runs fp32: logits agree closely, not exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ngram.draft import tree_layout
from server.reused_arrays import ReusedArrays

BLOCK = 32  # input features per int8 scale


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [N, K] -> (int8 codes [N, K], fp32 scales [N, K/32]): per 32-value block, scale =
    max|w| / 127 and codes = round-half-even(w / scale) (Q8_0's rule, the one the activations get)."""
    from server import cpu_kernels

    return cpu_kernels.quantize_rows(w)


@dataclass
class Int8Linear:
    """codes and scales are the weight (Q8_0; embedding row lookups read them); packed is the same
    weight re-laid out once for the C kernels' SIMD matmul (cpu_kernels.pack_weight), None for a
    table only ever looked up (or without the C kernels): matmul_q8 then packs per call."""
    codes: np.ndarray   # int8 [N, K]
    scales: np.ndarray  # fp32 [N, K / 32]
    packed: np.ndarray | None = None  # uint8, pack_q8's layout of codes and scales

    @classmethod
    def of(cls, *weights: np.ndarray, pack: bool = True) -> "Int8Linear":
        """One linear computing the given weights' outputs side by side (fused); pack=False for a
        table that is only looked up by row (no packed copy)."""
        from server import cpu_kernels

        codes, scales = quantize_weight(np.concatenate(weights, axis=0))
        codes, scales = np.ascontiguousarray(codes), np.ascontiguousarray(scales)
        return cls(codes, scales, cpu_kernels.pack_weight(codes, scales) if pack else None)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.packed is None else self.packed.nbytes)


def unsupported_reason(model) -> str | None:
    """None when `CpuGemma.from_hf(model)` serves this model, else why not (the eager path serves it)."""
    c = model.config
    kind = getattr(c, "model_type", None)
    if kind not in ("gemma3_text", "gemma4_text") or not hasattr(getattr(model, "model", None), "layers"):
        return f"takes Gemma 3 and Gemma 4 text models (this one is {kind or type(model).__name__})"
    if getattr(c, "enable_moe_block", False):
        return "does not implement Gemma 4's MoE layers"
    if getattr(c, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        return f"implements gelu-tanh only (this model uses {c.hidden_activation})"
    if getattr(c, "attn_logit_softcapping", None):
        return "does not implement attention logit soft-capping"
    widths = {c.hidden_size, getattr(c, "hidden_size_per_layer_input", 0) or BLOCK}
    for layer in model.model.layers:
        widths |= {layer.self_attn.o_proj.in_features, layer.mlp.down_proj.in_features}
    if any(w % BLOCK for w in widths):
        return f"needs input widths that are multiples of {BLOCK} (this model has {sorted(widths)})"
    return None


class KVCache:
    """Keys and values of every layer that owns a cache, [kv_heads, max_len, head_dim] each, of the
    kernels' KV_DTYPE (float16 for server.cpu_kernels: a key or value is rounded once, when it is
    written) (`k[i]` is None for a Gemma 4 KV-shared layer, which reads its source layer's)."""

    def __init__(self, shapes: list[tuple[int, int] | None], max_len: int, dtype=np.float16):
        self.shapes, self.max_len, self.dtype = shapes, max_len, dtype
        self.k = [None if s is None else np.zeros((s[0], max_len, s[1]), dtype=dtype) for s in shapes]
        self.v = [None if s is None else np.zeros((s[0], max_len, s[1]), dtype=dtype) for s in shapes]

    def copy_prefix(self, length: int, max_len: int) -> "KVCache":
        """A new cache of `max_len` positions holding this one's first `length`."""
        out = KVCache(self.shapes, max_len, self.dtype)
        for mine, theirs in ((out.k, self.k), (out.v, self.v)):
            for i, t in enumerate(theirs):
                if t is not None:
                    mine[i][:, :length] = t[:, :length]
        return out

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v) if t is not None)

    def keep_path(self, start: int, rows: list[int]) -> None:
        """After a tree step written at slots start..: move step rows `rows` (increasing) to
        start, start + 1, ... (a row never moves up, so in order no source is overwritten first)."""
        moves = [(start + i, start + r) for i, r in enumerate(rows) if r != i]
        if not moves:
            return
        dst, src = np.array([d for d, _ in moves]), np.array([s for _, s in moves])
        for t in (*self.k, *self.v):
            if t is not None:
                t[:, dst] = t[:, src]


class Rows:
    """One sequence's part of a forward: `ids` at positions start.. of `cache` (a token tree when
    `parents` is given: tree_layout), and whether only its last row's logits are wanted."""

    __slots__ = ("ids", "start", "cache", "last_only", "positions", "tree")

    def __init__(self, ids, start: int, cache: KVCache, last_only: bool = False, parents=None):
        self.ids = np.asarray(ids, dtype=np.int64)
        self.start, self.cache, self.last_only = int(start), cache, last_only
        if parents is None:
            self.positions = np.arange(self.start, self.start + self.ids.shape[0], dtype=np.int64)
            self.tree = None
        else:  # a token tree: row j at start + depth(j), seeing the cache and its ancestors
            depth, ancestors = tree_layout(parents)
            if depth.shape[0] != self.ids.shape[0]:
                raise ValueError(f"{len(parents)} parents for {self.ids.shape[0]} ids")
            self.positions, self.tree = self.start + depth, (self.start, ancestors)


class CpuGemma:
    """Gemma 3 and Gemma 4 text models (see the module docstring); `from_hf` builds one."""

    def __init__(self, cfg: dict, embed: Int8Linear, lm_head: Int8Linear, layers: list[dict],
                 final_norm: np.ndarray | None, rotary, ple: dict | None, kernels):
        self.embed, self.lm_head, self.layers = embed, lm_head, layers
        self.final_norm, self.rotary, self.ple, self.k = final_norm, rotary, ple, kernels
        self.eps = np.float32(cfg["eps"])
        self.embed_scale = np.float32(cfg["embed_scale"])
        self.window, self.softcap = cfg["window"], cfg["softcap"]
        self._rope: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # Each forward's logits go into a reused buffer (server/reused_arrays.py says why); the
        # callers' views keep theirs out of reach until they drop them.
        self.logits_buffers = ReusedArrays()

    @classmethod
    def from_hf(cls, model, kernels=None) -> "CpuGemma":
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the CPU int8 path {reason}")
        c = model.config
        m = model.model
        gemma3 = c.model_type == "gemma3_text"
        arr = lambda t: t.detach().float().cpu().numpy()

        def norm(mod):
            """The norm's weight as applied: Gemma3RMSNorm's (1 + w), Gemma4RMSNorm's w, or None (no scale)."""
            if mod is None or getattr(mod, "weight", None) is None:
                return None
            return ((1.0 + arr(mod.weight)) if gemma3 else arr(mod.weight)).astype(np.float32)

        types = list(c.layer_types)
        n = len(m.layers)
        first_shared = n - (getattr(c, "num_kv_shared_layers", 0) or 0)
        ple_dim = 0 if gemma3 else (getattr(c, "hidden_size_per_layer_input", 0) or 0)
        layers = []
        for i, layer in enumerate(m.layers):
            a, mlp = layer.self_attn, layer.mlp
            shared = bool(getattr(a, "is_kv_shared_layer", False))
            source = max(j for j in range(first_shared) if types[j] == types[i]) if shared else i
            kv_heads = c.num_attention_heads // a.num_key_value_groups
            parts = [arr(a.q_proj.weight)]
            if not shared:
                parts.append(arr(a.k_proj.weight))
                v = getattr(a, "v_proj", None)
                parts.append(arr(v.weight) if v is not None else arr(a.k_proj.weight))  # k_eq_v: V is K
            scalar = getattr(layer, "layer_scalar", None)
            layers.append({
                "kind": types[i], "sliding": types[i] == "sliding_attention", "source": source,
                "head_dim": a.head_dim, "heads": c.num_attention_heads, "kv_heads": kv_heads, "scaling": float(a.scaling),
                "qkv": Int8Linear.of(*parts), "o": Int8Linear.of(arr(a.o_proj.weight)),
                "gate_up": Int8Linear.of(arr(mlp.gate_proj.weight), arr(mlp.up_proj.weight)),
                "down": Int8Linear.of(arr(mlp.down_proj.weight)),
                "in_norm": norm(layer.input_layernorm), "post_attn_norm": norm(layer.post_attention_layernorm),
                "pre_ffn_norm": norm(layer.pre_feedforward_layernorm), "post_ffn_norm": norm(layer.post_feedforward_layernorm),
                "q_norm": norm(a.q_norm), "k_norm": norm(getattr(a, "k_norm", None)),
                "v_norm": getattr(a, "v_norm", None) is not None, "v_norm_w": norm(getattr(a, "v_norm", None)),
                "scalar": None if scalar is None else np.float32(arr(scalar).reshape(-1)[0]),
                "ple_gate": Int8Linear.of(arr(layer.per_layer_input_gate.weight)) if ple_dim else None,
                "ple_proj": Int8Linear.of(arr(layer.per_layer_projection.weight)) if ple_dim else None,
                "ple_norm": norm(layer.post_per_layer_input_norm) if ple_dim else None,
            })
        ple = None
        if ple_dim:
            table = m.embed_tokens_per_layer
            ple = {"dim": ple_dim, "table": Int8Linear.of(arr(table.weight), pack=False),  # rows only
                   "table_scale": np.float32(arr(table.embed_scale).reshape(-1)[0]),
                   "proj": Int8Linear.of(arr(m.per_layer_model_projection.weight)),
                   "proj_scale": np.float32(m.per_layer_model_projection_scale),
                   "norm": norm(m.per_layer_projection_norm), "input_scale": np.float32(m.per_layer_input_scale)}
        head = getattr(model, "lm_head", None)
        tied = head is None or head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
        embed = Int8Linear.of(arr(m.embed_tokens.weight), pack=tied)  # packed when it is the LM head too
        cfg = {"eps": c.rms_norm_eps, "window": c.sliding_window,
               "embed_scale": float(arr(m.embed_tokens.embed_scale).reshape(-1)[0]),
               "softcap": getattr(c, "final_logit_softcapping", None) or None}
        if kernels is None:
            from server import cpu_kernels as kernels
        return cls(cfg, embed, embed if tied else Int8Linear.of(arr(head.weight)), layers, norm(m.norm),
                   m.rotary_emb, ple, kernels)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache([(L["kv_heads"], L["head_dim"]) if L["source"] == i else None
                        for i, L in enumerate(self.layers)], max_len, getattr(self.k, "KV_DTYPE", np.float32))

    def nbytes(self) -> int:
        lin = [self.embed] + ([self.lm_head] if self.lm_head is not self.embed else [])
        lin += [L[n] for L in self.layers for n in ("qkv", "o", "gate_up", "down", "ple_gate", "ple_proj") if L[n] is not None]
        if self.ple:
            lin += [self.ple["table"], self.ple["proj"]]
        return sum(x.nbytes() for x in lin)

    def forward(self, ids, start: int, cache: KVCache, last_only: bool = False, parents=None) -> np.ndarray:
        return self.forward_batch([Rows(ids, start, cache, last_only, parents)])[0]

    def forward_batch(self, batch: list["Rows"]) -> list[np.ndarray]:
        """Several sequences in one forward: their rows share every matmul (each row's arithmetic is
        its own, so a sequence's logits are the ones it gets alone, bit for bit), and each attends to
        its own cache. Returns each one's logits, in order."""
        spans, at = [], 0
        for r in batch:
            n = r.ids.shape[0]
            if r.start + n > r.cache.max_len:
                raise ValueError(f"positions {r.start}..{r.start + n - 1} exceed the cache's {r.cache.max_len}")
            spans.append((at, at + n))
            at += n
        m = at
        ids = np.concatenate([r.ids for r in batch]) if len(batch) > 1 else batch[0].ids
        k = self.k
        x = _rows(self.embed, ids) * self.embed_scale
        ple = self._per_layer_inputs(ids, x) if self.ple else None
        positions = np.concatenate([r.positions for r in batch]) if len(batch) > 1 else batch[0].positions
        rope = {}  # layer kind -> every row's cos, sin [M, D]
        for i, L in enumerate(self.layers):
            D, kvh, heads = L["head_dim"], L["kv_heads"], L["heads"]
            qkv = k.linear(self._norm(x, L["in_norm"]), L["qkv"])
            if L["kind"] not in rope:
                cos, sin = self._cos_sin(L["kind"], int(positions.max()) + 1)
                rope[L["kind"]] = (cos[positions], sin[positions])
            cos, sin = rope[L["kind"]]
            q_all = k.rope(self._norm(qkv[:, : heads * D].reshape(m, heads, D), L["q_norm"]), cos, sin)
            if L["source"] == i:
                kv_at = heads * D  # q, then k, then v in the fused projection
                key_all = k.rope(self._norm(qkv[:, kv_at : kv_at + kvh * D].reshape(m, kvh, D), L["k_norm"]), cos, sin)
                value_all = qkv[:, kv_at + kvh * D :].reshape(m, kvh, D)
                if L["v_norm"]:
                    value_all = self._norm(value_all, L["v_norm_w"])
            window = self.window if L["sliding"] else 0
            group = heads // kvh
            attn = np.empty((m, heads, D), dtype=np.float32)
            if L["source"] == i:
                for r, (lo, hi) in zip(batch, spans):
                    r.cache.k[i][:, r.start : r.start + hi - lo] = key_all[lo:hi].transpose(1, 0, 2)
                    r.cache.v[i][:, r.start : r.start + hi - lo] = value_all[lo:hi].transpose(1, 0, 2)
            for g in range(kvh):  # each KV head with the query heads that read it, every sequence at once
                heads_g = slice(g * group, (g + 1) * group)
                outs = k.attention_many([
                    (np.ascontiguousarray(q_all[lo:hi, heads_g]), r.cache.k[L["source"]][g], r.cache.v[L["source"]][g],
                     r.positions, window, L["scaling"], *(r.tree or ())) for r, (lo, hi) in zip(batch, spans)])
                for (lo, hi), out in zip(spans, outs):
                    attn[lo:hi, heads_g] = out
            x = self._norm(k.linear(attn.reshape(m, heads * D), L["o"]), L["post_attn_norm"], residual=x)
            gate_up = k.linear(self._norm(x, L["pre_ffn_norm"]), L["gate_up"])
            x = self._norm(k.linear(k.gelu_mul(gate_up), L["down"]), L["post_ffn_norm"], residual=x)
            if ple is not None:
                gated = k.gelu_mul(k.linear(x, L["ple_gate"]), ple[:, i])
                x = self._norm(k.linear(gated, L["ple_proj"]), L["ple_norm"], residual=x)
            if L["scalar"] is not None:
                x = x * L["scalar"]
        # a prefill chunk reads only its last row's logits (the LM head is most of the work)
        keep = [np.arange(hi - 1, hi) if r.last_only else np.arange(lo, hi) for r, (lo, hi) in zip(batch, spans)]
        rows = np.concatenate(keep)
        if rows.shape[0] < m:
            x = x[rows]
        logits = k.linear(self._norm(x, self.final_norm), self.lm_head,
                          out=self.logits_buffers.empty((x.shape[0], self.lm_head.out_features)))
        if self.softcap:  # in place: no more arrays of the logits' size (tens of MB for a verify)
            cap = np.float32(self.softcap)
            np.divide(logits, cap, out=logits)
            np.tanh(logits, out=logits)
            np.multiply(logits, cap, out=logits)
        out, at = [], 0
        for rows_of in keep:
            out.append(logits[at : at + rows_of.shape[0]])
            at += rows_of.shape[0]
        return out

    def _per_layer_inputs(self, ids: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Gemma 4's per-layer inputs [M, layers, dim]: (norm(proj(x) * proj_scale) + table rows) * input_scale."""
        p, m, n = self.ple, ids.shape[0], len(self.layers)
        tok = (_rows(p["table"], ids) * p["table_scale"]).reshape(m, n, p["dim"])
        proj = (self.k.linear(x, p["proj"]) * p["proj_scale"]).reshape(m, n, p["dim"])
        return ((self._norm(proj, p["norm"]) + tok) * p["input_scale"]).astype(np.float32)

    def _norm(self, x: np.ndarray, weight: np.ndarray | None, residual: np.ndarray | None = None) -> np.ndarray:
        """[residual +] RMSNorm over the last axis, float32, each row on its own (weight None: no scale)."""
        return self.k.rms_norm(x, weight, self.eps, residual)

    def _cos_sin(self, kind: str, end: int) -> tuple[np.ndarray, np.ndarray]:
        """RoPE tables for positions 0..end-1 from transformers' own rotary module (grown by doubling)."""
        have = self._rope.get(kind)
        if have is None or have[0].shape[0] < end:
            import torch

            n = max(1024, 1 << max(0, (end - 1).bit_length()))
            with torch.no_grad():
                cos, sin = self.rotary(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None], kind)
            have = (cos[0].float().numpy(), sin[0].float().numpy())
            self._rope[kind] = have
        return have


def _rows(lin: Int8Linear, ids: np.ndarray) -> np.ndarray:
    """Rows of an int8 table (embeddings), dequantized to float32."""
    return (lin.codes[ids].astype(np.float32).reshape(len(ids), -1, BLOCK) * lin.scales[ids][:, :, None]).reshape(len(ids), -1)
