"""Attention of a decode or verify step (1..max_bucket new tokens) over the static cache, on the GPU.

Contract: `StepAttention(kv_heads, group, head_dim, max_slots, max_tokens, device)` allocates its
scratch once; `attn(q, k_cache, v_cache, kv_len, qpos, slot_pos, window, scaling)` with q [T, H, D]
bf16 (H = kv_heads * group), caches [kv_heads, slots, D], qpos [T] (each query's position), and
`slot_pos` [slots] (the ring's positions) for a sliding layer or None for a full layer, returns
[T, H * D]: softmax(q k^T * scaling) v over the visible keys (full: position <= the query's;
sliding: also > query - window), softmax in fp32.

Same meaning as server/fast_path.py's `_attention`, computed so that a query's output is
bit-identical whatever other queries share the step (batch invariance, as server/small_m_matmul.py
explains): keys are cut into fixed chunks of BLOCK_S slots; one program computes a chunk's partial
(max, sum of exponentials, unnormalized output) for 16 query rows, each row on its own; a second
kernel merges one row's chunks in chunk order. Full layers skip the chunks past the last query
position, so a step reads the keys up to the context, not the whole cache.
"""
from __future__ import annotations

import torch

BLOCK_R = 16   # query rows (token x head of one KV head) per program


def _block_s(head_dim: int) -> int:
    return 64 if head_dim > 256 else 128


class StepAttention:
    def __init__(self, kv_heads: int, group: int, head_dim: int, max_slots: int, max_tokens: int, device):
        self.kv_heads, self.group, self.head_dim = kv_heads, group, head_dim
        self.block_s = _block_s(head_dim)
        self.n_chunks = -(-max_slots // self.block_s)
        self.n_rows = -(-(max_tokens * group) // BLOCK_R) * BLOCK_R
        rows = kv_heads * self.n_rows * self.n_chunks
        self.m = torch.empty(rows, dtype=torch.float32, device=device)
        self.l = torch.empty(rows, dtype=torch.float32, device=device)
        self.acc = torch.empty(rows * head_dim, dtype=torch.float32, device=device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                 qpos: torch.Tensor, slot_pos: torch.Tensor | None, window: int, scaling: float) -> torch.Tensor:
        from server.gpu_kernels import _step_attention_chunk, _step_attention_combine
        T, H, D = q.shape
        if q.stride(-1) != 1:
            q = q.contiguous()
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
        _step_attention_combine[(self.kv_heads, T * self.group)](
            self.m, self.l, self.acc, qpos, out, out.stride(0), self.n_rows, self.n_chunks, chunks,
            G=self.group, D=D, SLIDING=sliding, BLOCK_S=self.block_s, num_warps=4)
        return out
