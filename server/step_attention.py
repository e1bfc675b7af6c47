"""Attention of a decode or verify step (1..max_bucket new tokens, a chain or a token tree) over the
static cache, on the GPU.

Contract: `StepAttention(kv_heads, group, head_dim, max_slots, max_tokens, device)` allocates its
scratch once; `attn(q, k_cache, v_cache, kv_len, qpos, slot_pos, window, scaling, anc=None)` with
q [T, H, D] bf16 (H = kv_heads * group), caches [kv_heads, slots, D], qpos [T] (each query's
position), `slot_pos` [slots] (the ring's positions) for a sliding layer or None for a full layer,
and `anc` [T] int64 (bit j of anc[t]: row j is t itself or an ancestor of t; None: a chain, row t
sees rows 0..t), returns [T, H * D]: softmax(q k^T * scaling) v over the visible keys, softmax in
fp32. The step's rows wrote their K/V at slot qpos[0] + j (modulo the ring on a sliding layer);
qpos[t] = qpos[0] + depth(t). Visible to row t: keys from before the step (position < qpos[0]:
full layers slot < qpos[0], sliding layers slot_pos in that range and > qpos[t] - window) and the
step's rows whose bit is set in anc[t] (sliding: also within the window by depth).

Same meaning as server/fast_path.py's `_attention`, computed so that a query's output is
bit-identical whatever other queries share the step (batch invariance, as server/small_m_matmul.py
explains) and whichever rows of the step its ancestors are: keys from before the step are cut into
fixed chunks of BLOCK_S slots; one program computes a chunk's partial (max, sum of exponentials,
unnormalized output) for 16 query rows, each row on its own; the step's own keys are one more
chunk per token, laid out by depth (column c = the ancestor at depth c), so a tree node's
arithmetic is a chain row's; a third kernel merges one row's chunks in a fixed order. Full layers
skip the chunks past the step's first slot, so a step reads the keys up to the context, not the
whole cache.
"""
from __future__ import annotations

import torch

BLOCK_R = 16   # query rows (token x head of one KV head) per program


def _block_s(head_dim: int) -> int:
    return 64 if head_dim > 256 else 128


def chain_ancestors(n: int) -> list[int]:
    """anc of a chain of n rows: row t sees rows 0..t (as int64 values: bit 63 is the sign)."""
    return [((1 << (t + 1)) - 1) - (1 << 64 if t == 63 else 0) for t in range(n)]


class StepAttention:
    def __init__(self, kv_heads: int, group: int, head_dim: int, max_slots: int, max_tokens: int, device):
        if group > BLOCK_R or max_tokens > 64:
            raise ValueError(f"{group} query heads per KV head or {max_tokens} tokens: at most {BLOCK_R} and 64")
        self.kv_heads, self.group, self.head_dim = kv_heads, group, head_dim
        self.block_s = _block_s(head_dim)
        self.block_t = max(16, 1 << max(0, (max_tokens - 1).bit_length()))  # the step's own keys: one chunk
        self.n_chunks = -(-max_slots // self.block_s) + 1   # the last one holds the step's own keys
        self.n_rows = -(-(max_tokens * group) // BLOCK_R) * BLOCK_R
        rows = kv_heads * self.n_rows * self.n_chunks
        self.m = torch.empty(rows, dtype=torch.float32, device=device)
        self.l = torch.empty(rows, dtype=torch.float32, device=device)
        self.acc = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.chain = torch.tensor(chain_ancestors(max_tokens), dtype=torch.int64, device=device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                 qpos: torch.Tensor, slot_pos: torch.Tensor | None, window: int, scaling: float,
                 anc: torch.Tensor | None = None) -> torch.Tensor:
        from server.gpu_kernels import _step_attention_chunk, _step_attention_combine, _step_attention_own
        T, H, D = q.shape
        if q.stride(-1) != 1:
            q = q.contiguous()
        anc = self.chain[:T] if anc is None else anc
        sliding = slot_pos is not None
        slots = k_cache.shape[1] if sliding else kv_len
        chunks = -(-slots // self.block_s)
        out = torch.empty((T, H * D), dtype=q.dtype, device=q.device)
        warps = 8 if D > 256 else 4
        _step_attention_chunk[(self.kv_heads, -(-(T * self.group) // BLOCK_R), chunks)](
            q, k_cache, v_cache, slot_pos if sliding else qpos, qpos, self.m, self.l, self.acc,
            T, slots, window, scaling, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            self.n_rows, self.n_chunks,
            G=self.group, D=D, SLIDING=sliding, BLOCK_R=BLOCK_R, BLOCK_S=self.block_s, num_warps=warps)
        _step_attention_own[(self.kv_heads, T)](
            q, k_cache, v_cache, qpos, anc, self.m, self.l, self.acc,
            T, k_cache.shape[1], window, scaling, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            self.n_rows, self.n_chunks,
            G=self.group, D=D, SLIDING=sliding, BLOCK_R=BLOCK_R, BLOCK_T=self.block_t, num_warps=warps)
        _step_attention_combine[(self.kv_heads, T * self.group)](
            self.m, self.l, self.acc, qpos, out, out.stride(0), self.n_rows, self.n_chunks, chunks,
            G=self.group, D=D, SLIDING=sliding, BLOCK_S=self.block_s, num_warps=4)
        return out
