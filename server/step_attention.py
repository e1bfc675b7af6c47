"""Attention of a decode or verify step (1..max_bucket new tokens, a chain or a token tree) over the
static cache, on the GPU.

Contract: `StepAttention(kv_heads, group, head_dim, max_slots, max_tokens, device)` allocates its
scratch once; `attn(q, k_cache, v_cache, kv_len, qpos, slot_pos, window, scaling, path=None,
new_kv=None)` with q [T, H, D] bf16 (H = kv_heads * group), caches [kv_heads, slots, D], qpos [T]
(each query's position), `slot_pos` [slots] (the ring's positions) for a sliding layer or None for
a full layer, and `path` [T, >= T] int64 (path[t, j]: the row of t's ancestor at depth j, for j <=
depth(t); None: a chain, path[t, j] = j), returns [T, H * D]: softmax(q k^T * scaling) v over the
visible keys, softmax in fp32. The step's row j wrote its K/V at slot qpos[0] + j (modulo the ring
on a sliding layer) and sits at qpos[t] = qpos[0] + depth(t). Row t sees the keys of positions before
the step (full: position <= its own; sliding: also > qpos[t] - window) and, at position qpos[0] + j,
the key of its ancestor at depth j: the keys a chain of its root path would see.
`new_kv=(k, v)` ([>= T, kv_heads, D] each, the caches' dtype): the step's own K/V rows, not yet in
the caches; the launch writes row j at slot qpos[0] + j (modulo the ring) and reads the step's
positions from k / v. A sliding layer's `slot_pos` must already map those slots to the step's
positions (server/fast_path.py Segment.prepare does, before the layers): that is how the launch
knows a slot is the step's, so no program reads a slot while another writes it.

Same meaning as server/fast_path.py's `_attention`, computed so that a query's output is
bit-identical whatever other queries share the step and wherever the step starts (batch
invariance, as server/small_m_matmul.py explains): keys are cut into fixed, position-aligned chunks
of BLOCK_S slots (full layers: slot = position; sliding: the ring's slots), and a row's partial
over a chunk (max, sum of exponentials, unnormalized output) is computed on its own. Chunks the
step did not write hold the same keys for every row: one program does 16 query rows
(`_chunk_partials`). The chunks the step wrote into (at most 2, 3 on a ring that wraps) are
done one token at a time (`_own_partials`): the step's keys are gathered into the chunk by
depth (column of position s + j = the ancestor at depth j), so a tree node's columns are the ones
its path's chain row has, and for a chain every column reads its own slot. Both call one partial
function, so a chain row's bits do not depend on which kind of program did a chunk: a 64-token
verify equals 64 one-token steps, and a tree row equals its path's chain row. Both kinds run in one
launch (`_step_attention_partials`); a second kernel merges one row's chunks in chunk order. Full
layers skip the chunks past each query's position, so a step reads the keys up to the context, not
the whole cache.

The step's own K/V rows can be handed to the launch (`new_kv`) instead of written into the cache
before it: the launch writes them, and reads the step's positions from them (the values the cache
would hold), so the KV write of a layer costs no launch of its own.
"""
from __future__ import annotations

import torch

BLOCK_R = 16   # query rows (token x head of one KV head) per program
# Keys a chunk holds (BLOCK_S): for heads of at most 256 dimensions (E4B's sliding layers), and wider
# (its full layers). Part of the bits (a row's partials are per chunk), the same for every step, and
# read when a StepAttention is built (and by server/fast_memory.py's plan: a full layer's scratch
# grows as its chunks shrink). Sliding layers' chunks of 64 keys instead of 128, twice the programs
# for half the keys each (one run of `python -m bench.step_ab --base-tree . --head-set
# "server.step_attention.CHUNK_KEYS=(64, 64)" --rounds 1 --reps 100` on an H100, with the merge's
# reads ahead: bench/results/step_ab-chunk-keys-h100.md): a one-token step's partials 0.326 -> 0.362
# ms and merges 0.100 -> 0.130, the step 3.12 -> 3.24 ms, a verify 3.56 -> 3.66. Not taken.
CHUNK_KEYS: tuple[int, int] = (128, 64)
# Warps of a partials program, for heads of at most 256 dimensions and wider (as CHUNK_KEYS; the
# merge's are its own). A program's softmax sums run across its warps, so a count is part of the
# bits, the same for every step. In the sm_90a code of a sliding layer's launch (D 256, 128 keys,
# writing its rows; ptxas on the CPU) 4 warps take 255 registers a thread and spill 104 bytes, 8 take
# 220 and spill none (D 512 on 8: 155, no spill). Not yet timed: `python -m bench.step_ab --base-tree
# . --head-set "server.step_attention.ATTENTION_WARPS=(8, 8)"`.
ATTENTION_WARPS: tuple[int, int] = (4, 8)


def _block_s(head_dim: int) -> int:
    return CHUNK_KEYS[1] if head_dim > 256 else CHUNK_KEYS[0]


def chain_ancestors(n: int) -> list[int]:
    """anc of a chain of n rows: row t sees rows 0..t (as int64 values: bit 63 is the sign)."""
    return [((1 << (t + 1)) - 1) - (1 << 64 if t == 63 else 0) for t in range(n)]


def chain_paths(n: int) -> torch.Tensor:
    """path of a chain of n rows [n, n] int64: the ancestor of row t at depth j is row j."""
    return torch.arange(n, dtype=torch.int64).repeat(n, 1)


class StepAttention:
    def __init__(self, kv_heads: int, group: int, head_dim: int, max_slots: int, max_tokens: int, device):
        if group > BLOCK_R:
            raise ValueError(f"{group} query heads per KV head: at most {BLOCK_R}")
        self.kv_heads, self.group, self.head_dim = kv_heads, group, head_dim
        self.block_s = _block_s(head_dim)
        self.n_chunks = -(-max_slots // self.block_s)
        self.n_rows = -(-(max_tokens * group) // BLOCK_R) * BLOCK_R
        rows = kv_heads * self.n_rows * self.n_chunks
        self.m = torch.empty(rows, dtype=torch.float32, device=device)
        self.l = torch.empty(rows, dtype=torch.float32, device=device)
        self.acc = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.chain = chain_paths(max_tokens).to(device)
        from server.small_m_matmul import pdl_launch
        self._launch = pdl_launch(torch.device(device))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int,
                 qpos: torch.Tensor, slot_pos: torch.Tensor | None, window: int, scaling: float,
                 path: torch.Tensor | None = None, new_kv: tuple | None = None) -> torch.Tensor:
        from server.gpu_kernels import _step_attention_partials
        T, H, D = q.shape
        if q.stride(-1) != 1:
            q = q.contiguous()
        path = self.chain if path is None else path
        assert path.stride(1) == 1 and path.shape[0] >= T and path.shape[1] >= T
        sliding = slot_pos is not None
        slots = k_cache.shape[1] if sliding else kv_len
        chunks, own_chunks, grid = self._grid(T, slots, sliding)
        out = torch.empty((T, H * D), dtype=q.dtype, device=q.device)
        nk, nv = _new_rows(new_kv, k_cache, T, self.kv_heads, D)
        _step_attention_partials[(self.kv_heads, *grid)](
            q, k_cache, v_cache, slot_pos if sliding else qpos, qpos, path, self.m, self.l, self.acc,
            T, slots, chunks, own_chunks, window, scaling, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            path.stride(0), self.n_rows, self.n_chunks, nk, nv, nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1),
            G=self.group, D=D, SLIDING=sliding, BLOCK_R=BLOCK_R, BLOCK_S=self.block_s, WRITE=new_kv is not None,
            num_warps=_warps(D), **self._launch)
        self._merge(qpos, out, T, chunks, sliding, D)
        return out

    def segments(self, q: torch.Tensor, table: torch.Tensor, k_field: int, v_field: int, S: int, T: int,
                 kv_len: int, qpos: torch.Tensor, sliding: bool, cache_slots: int, stride_kh: int, stride_ks: int,
                 stride_pt: int, stride_table: int, slot_pos_field: int, path_field: int, window: int,
                 scaling: float, new_kv: tuple | None = None) -> torch.Tensor:
        """S sequences' steps of T rows each (q [>= S*T, H, D], qpos [>= S*T]: segment s's rows from
        s*T; rows past S*T belong to no segment and get zeros),
        each over its own cache, ring positions and tree paths (the int64 addresses in row s of
        `table`: server/batch_step.py), in one launch of the partials and one of the merge: [S*T, H*D],
        segment s's rows the bits `__call__` gives its step alone (the same programs, on its pointers
        and its own rows of the scratch, sized here for S*T <= max_tokens rows). `new_kv`: as
        `__call__`'s, segment s's rows s*T.. written into its caches."""
        from server.gpu_kernels import _step_attention_partials_segments
        rows_out, H, D = q.shape
        R = S * T
        assert R <= rows_out and R * self.group <= self.n_rows
        if q.stride(-1) != 1:
            q = q.contiguous()
        slots = cache_slots if sliding else kv_len
        chunks, own_chunks, grid = self._grid(T, slots, sliding)
        out = (torch.empty if rows_out == R else torch.zeros)((rows_out, H * D), dtype=q.dtype, device=q.device)
        nk, nv = _new_rows(new_kv, q, R, self.kv_heads, D)
        _step_attention_partials_segments[(S * self.kv_heads, *grid)](
            q, table, k_field, v_field, qpos, self.m, self.l, self.acc, self.kv_heads,
            T, slots, chunks, own_chunks, window, scaling, q.stride(0), q.stride(1), stride_kh, stride_ks,
            stride_pt, stride_table, self.n_rows, self.n_chunks, nk, nv, nk.stride(0), nk.stride(1), nv.stride(0),
            nv.stride(1), SLOT_POS_FIELD=slot_pos_field, PATH_FIELD=path_field,
            G=self.group, D=D, SLIDING=sliding, BLOCK_R=BLOCK_R, BLOCK_S=self.block_s, WRITE=new_kv is not None,
            num_warps=_warps(D), **self._launch)
        self._merge(qpos, out, R, chunks, sliding, D)
        return out

    def _grid(self, T: int, slots: int, sliding: bool) -> tuple[int, int, tuple[int, int]]:
        """(chunks of the cache, chunks a step of T rows wrote into, the partials' grid past its
        first axis: row blocks, chunks + the own-chunk programs)."""
        chunks = -(-slots // self.block_s)
        # chunks the step wrote into: T positions span at most this many (one more where a ring's
        # last chunk is partial and the span wraps past it)
        own_chunks = -(-(T - 1) // self.block_s) + 1 + int(sliding)
        row_blocks = -(-(T * self.group) // BLOCK_R)
        own_programs = own_chunks * -(-T // row_blocks)  # each row block's share of the T tokens' own chunks
        return chunks, own_chunks, (row_blocks, chunks + own_programs)

    def _merge(self, qpos: torch.Tensor, out: torch.Tensor, rows: int, chunks: int, sliding: bool, D: int) -> None:
        """The merge of the partials of `rows` query rows into out (the scratch's rows 0.. in order)."""
        from server.gpu_kernels import _step_attention_combine
        _step_attention_combine[(self.kv_heads, rows * self.group)](
            self.m, self.l, self.acc, qpos, out, out.stride(0), self.n_rows, self.n_chunks, chunks,
            G=self.group, D=D, SLIDING=sliding, BLOCK_S=self.block_s, num_warps=4, **self._launch)


def _new_rows(new_kv: tuple | None, like: torch.Tensor, rows: int, kv_heads: int, D: int) -> tuple:
    """(K, V) [>= rows, kv_heads, D] of a step's new rows, checked: unit stride along D, the dtype
    and device of `like` (the cache, or q, which the cache's dtype follows); without new rows,
    `like` twice (a tensor the kernel never reads then)."""
    if new_kv is None:
        return like, like
    k, v = new_kv
    for t in (k, v):
        if t.dim() != 3 or t.shape[0] < rows or t.shape[1:] != (kv_heads, D) or t.stride(2) != 1:
            raise ValueError(f"new K/V rows of shape {tuple(t.shape)}, strides {t.stride()}: want "
                             f"[>= {rows}, {kv_heads}, {D}], unit stride along the head dimension")
        if t.dtype != like.dtype or t.device != like.device:
            raise ValueError(f"new K/V rows of {t.dtype} on {t.device} for a cache of {like.dtype} on {like.device}")
    return k, v


def _warps(head_dim: int) -> int:
    return ATTENTION_WARPS[1] if head_dim > 256 else ATTENTION_WARPS[0]
