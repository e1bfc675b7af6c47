"""Triton kernels of the fast path's steps (imported only on CUDA): the small-M matmul
(server/small_m_matmul.py states its contract) and step attention (server/step_attention.py).
Every step kernel starts with `_pdl_start`: on Hopper and later they are launched with
programmatic dependent launch (server/small_m_matmul.py `pdl_launch`)."""
import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

try:  # in the Triton this project pins (3.6); older ones may lack them
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_PDL = True
except ImportError:  # an older Triton: the kernels run without PDL (pdl_launch asks HAS_PDL)
    HAS_PDL = False


# Under Triton's interpreter the merge loops run to an argument (it cannot loop to a bound read from
# memory), with the chunks past a row's last masked; compiled, to the row's last chunk, as they always did.
_MERGE_TO_ARGUMENT = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
# Chunks whose maxima the merge reads at once (`_store_merged_row`).
MERGE_MAX_BLOCK = tl.constexpr(32)


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL: launched with launch_pdl, server/small_m_matmul.py
    `pdl_launch`), a kernel may start while the one before it on the stream finishes: it waits
    here, before touching any memory, for that kernel to end and its writes to be visible, then lets
    the next kernel start its own launch. What it saves is the launch gap between kernels, not
    any arithmetic: the outputs are the same bits."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _x_tile(x_ptr, stride_xm, M, tile, ks, BLOCK_M: tl.constexpr):
    """Rows tile*BLOCK_M.. of x at columns ks (rows past M read as 0)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows < M)[:, None], other=0.0)


@triton.jit
def _store_partial(partial_ptr, acc, tile, pid_k, M, N, cols, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                   REDUCE: tl.constexpr = True):
    """One row tile's partial of K slice pid_k; padding rows (>= M) are neither written nor read back.
    A K slice's partials are ROWS rows apart when this launch sums them, M rows apart when it leaves
    them to the next kernel (REDUCE False: a contiguous [SPLIT, M, N] tensor, SmallMLinear.slices)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slice_rows = ROWS if REDUCE else M
    tl.store(partial_ptr + pid_k * slice_rows * N + rows[:, None] * N + cols[None, :], acc, mask=(rows < M)[:, None])


if os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter has no libdevice: tanh from exp (tests only)
    @triton.jit
    def _tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))
        return tl.where(x < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
else:
    @triton.jit
    def _tanh(x):
        return libdevice.tanh(x)   # as torch.compile's kernels compute tanh


@triton.jit
def _gelu(a):
    """transformers' gelu_pytorch_tanh in fp32, written as torch's decomposition of it (which
    torch.compile's kernel, server/fast_path.py `_gelu_mul`, computes): 0.5 a (1 + tanh(sqrt(2/pi)
    (a + 0.044715 a^3)))."""
    inner = 0.7978845608028654 * (a + 0.044715 * (a * a * a))
    return 0.5 * a * (1.0 + _tanh(inner))


@triton.jit
def _gelu_pairs(total, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's columns as (gate, up) pairs: column c < BLOCK_N / 2 is a gate column, c + BLOCK_N / 2
    its up column (`_columns`)."""
    return tl.split(tl.permute(tl.reshape(total, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _columns(pid_n, N, EPILOGUE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight columns program pid_n computes. GELU_PAIRS: the first half of its tile is gate
    columns pid_n * BLOCK_N / 2.., the second half the up columns N / 2 later (W = gate | up), so a
    tile holds whole pairs. A column's sums do not depend on the tile it is in."""
    c = tl.arange(0, BLOCK_N)
    if EPILOGUE == 1:
        return pid_n * (BLOCK_N // 2) + c % (BLOCK_N // 2) + (c // (BLOCK_N // 2)) * (N // 2)
    return pid_n * BLOCK_N + c


@triton.jit
def _store_out(out_ptr, acc, tile, M, N, pid_n, cols, u_ptr, stride_u, EPILOGUE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAP: tl.constexpr = 0.0):
    """A row tile's output (see `_small_m_kernel` for EPILOGUE). The epilogues round the product to
    the output's dtype first, as an unfused gelu would read it."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    live = (rows < M)[:, None]
    ty = out_ptr.dtype.element_ty
    if EPILOGUE == 0:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(ty), mask=live)
    elif EPILOGUE == 3:  # SOFTCAP: tanh(y / CAP) * CAP (Gemma's final logit soft-capping, server/fast_ops.py)
        y = _tanh(acc.to(ty).to(tl.float32) / CAP) * CAP
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(ty), mask=live)
    elif EPILOGUE == 1:
        gate, up = _gelu_pairs(acc, BLOCK_M, BLOCK_N)
        y = _gelu(gate.to(ty).to(tl.float32)) * up.to(ty).to(tl.float32)
        half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + rows[:, None] * (N // 2) + half[None, :], y.to(ty), mask=live)
    else:
        times = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=live, other=0.0).to(tl.float32)
        y = _gelu(acc.to(ty).to(tl.float32)) * times
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(ty), mask=live)


@triton.jit
def _sum_partials(partial_ptr, out_ptr, tile, M, N, pid_n, cols, u_ptr, stride_u, EPILOGUE: tl.constexpr,
                  SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAP: tl.constexpr = 0.0):
    """One row tile's output: its K slices' partials summed in slice order (a fixed order)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offsets = rows[:, None] * N + cols[None, :]
    live = (rows < M)[:, None]
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Unrolled, so the SPLIT loads are in flight together; fixed order: the sum does not depend on arrival order.
    for s in tl.static_range(SPLIT):
        total += tl.load(partial_ptr + s * ROWS * N + offsets, mask=live, other=0.0, cache_modifier=".cg")
    _store_out(out_ptr, total, tile, M, N, pid_n, cols, u_ptr, stride_u, EPILOGUE, BLOCK_M, BLOCK_N, CAP)


@triton.jit
def _add_group(acc0, acc1, acc2, acc3, g0, g1, g2, g3, TILES: tl.constexpr):
    """A K group's sums (from zero) added to each row tile's running sum: the int4 step matmuls' one
    order of addition, here and in server/gluon_matmul.py (Gluon calls this Triton helper as it is)."""
    acc0 += g0
    if TILES > 1:
        acc1 += g1
    if TILES > 2:
        acc2 += g2
    if TILES > 3:
        acc3 += g3
    return acc0, acc1, acc2, acc3


@triton.jit
def _small_m_kernel(x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, count_ptr, out_ptr,
                    M, N, K, stride_xm, k_per_split, u_ptr, stride_u,
                    INT4: tl.constexpr, SPLIT: tl.constexpr, MAGIC: tl.constexpr, TILES: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INT8: tl.constexpr = False, PDL: tl.constexpr = False, EPILOGUE: tl.constexpr = 0,
                    REDUCE: tl.constexpr = True, CAP: tl.constexpr = 0.0):
    """y[:M] = x @ W^T for one (N tile, K slice). W is int4 (INT4), int8 (INT8: codes [K, N], one
    scale per group of BLOCK_K features and column) or dense bf16 [N, K]. Rows come in TILES tiles of BLOCK_M (16) rows, each
    with its own accumulator and its own tl.dot of the one shape a single tile uses; ROWS = TILES *
    BLOCK_M is the partials' rows per K slice. A weight tile is loaded (and its int4 codes decoded)
    once for all row tiles. Invariant: row i's sums are the same instructions in the same order
    whatever TILES is, so per-row bits do not depend on the bucket. Up to 4 tiles (64 rows).

    EPILOGUE (what is stored, each a row's own arithmetic): 0 y itself; 1 (GELU_PAIRS, W = gate | up,
    N / 2 output columns) gelu(gate) * up, the MLP's activation fused into its gate|up matmul; 2
    (GELU_TIMES) gelu(y) * u, u [M, N] with row stride stride_u (Gemma 4's per-layer input gate); 3
    (SOFTCAP) tanh(y / CAP) * CAP, the LM head's logits soft-capped in its own store.
    The gelu reads y rounded to the output's dtype, as it reads a stored y. REDUCE False (split-K
    only; SmallMLinear.slices): each K slice stores its partial, [SPLIT, M, N] contiguous, and the
    program ends, out not written: the kernel that reads y sums them (no counter, no fence, no tail)."""
    _pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = _columns(pid_n, N, EPILOGUE, BLOCK_N)
    sub = tl.arange(0, 16)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for i in range(0, k_per_split // BLOCK_K):
        k0 = k_begin + i * BLOCK_K
        if INT4:
            # One group of 128 codes per column: 16 words, word r holding k0 + 16 j + r in nibble j.
            packed = tl.load(w_ptr + (k0 // 8 + sub[:, None]) * N + cols[None, :])
            group = k0 // BLOCK_K
            scale = tl.load(scale_ptr + group * N + cols)[None, :]
            offset = tl.load(offset_ptr + group * N + cols)[None, :]
            # The group's eight products accumulate in the tensor-core accumulator itself (tl.dot's
            # acc operand: no separate add per product), from zero, then join the tile's running sum
            # once per group. Per row the same instructions whatever TILES is.
            g0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            g1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            g2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            g3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(8):
                nibble = (packed >> (4 * j)) & 0xF
                if MAGIC:  # bf16 bits 0x4300 | c are 128 + c: no int->float conversion (a slow op)
                    code = (nibble.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0
                else:
                    code = nibble.to(scale_ptr.dtype.element_ty)
                ks = k0 + 16 * j + sub
                w = (code * scale + offset).to(x_ptr.dtype.element_ty)
                g0 = tl.dot(_x_tile(x_ptr, stride_xm, M, 0, ks, BLOCK_M), w, g0)
                if TILES > 1:
                    g1 = tl.dot(_x_tile(x_ptr, stride_xm, M, 1, ks, BLOCK_M), w, g1)
                if TILES > 2:
                    g2 = tl.dot(_x_tile(x_ptr, stride_xm, M, 2, ks, BLOCK_M), w, g2)
                if TILES > 3:
                    g3 = tl.dot(_x_tile(x_ptr, stride_xm, M, 3, ks, BLOCK_M), w, g3)
            acc0, acc1, acc2, acc3 = _add_group(acc0, acc1, acc2, acc3, g0, g1, g2, g3, TILES)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            if INT8:  # codes [K, N] int8, W = code * scale (the group's scale, one per column)
                codes = tl.load(w_ptr + ks[:, None] * N + cols[None, :])
                scale = tl.load(scale_ptr + (k0 // BLOCK_K) * N + cols)[None, :]
                w = (codes.to(tl.float32) * scale.to(tl.float32)).to(x_ptr.dtype.element_ty)
            else:  # dense bf16 W [N, K]: the tile W[cols, ks] transposed
                w = tl.load(w_ptr + cols[None, :] * K + ks[:, None])
            acc0 += tl.dot(_x_tile(x_ptr, stride_xm, M, 0, ks, BLOCK_M), w)
            if TILES > 1:
                acc1 += tl.dot(_x_tile(x_ptr, stride_xm, M, 1, ks, BLOCK_M), w)
            if TILES > 2:
                acc2 += tl.dot(_x_tile(x_ptr, stride_xm, M, 2, ks, BLOCK_M), w)
            if TILES > 3:
                acc3 += tl.dot(_x_tile(x_ptr, stride_xm, M, 3, ks, BLOCK_M), w)
    if SPLIT == 1:
        _store_out(out_ptr, acc0, 0, M, N, pid_n, cols, u_ptr, stride_u, EPILOGUE, BLOCK_M, BLOCK_N, CAP)
        if TILES > 1:
            _store_out(out_ptr, acc1, 1, M, N, pid_n, cols, u_ptr, stride_u, EPILOGUE, BLOCK_M, BLOCK_N, CAP)
        if TILES > 2:
            _store_out(out_ptr, acc2, 2, M, N, pid_n, cols, u_ptr, stride_u, EPILOGUE, BLOCK_M, BLOCK_N, CAP)
        if TILES > 3:
            _store_out(out_ptr, acc3, 3, M, N, pid_n, cols, u_ptr, stride_u, EPILOGUE, BLOCK_M, BLOCK_N, CAP)
    else:
        _store_partial(partial_ptr, acc0, 0, pid_k, M, N, cols, ROWS, BLOCK_M, REDUCE)
        if TILES > 1:
            _store_partial(partial_ptr, acc1, 1, pid_k, M, N, cols, ROWS, BLOCK_M, REDUCE)
        if TILES > 2:
            _store_partial(partial_ptr, acc2, 2, pid_k, M, N, cols, ROWS, BLOCK_M, REDUCE)
        if TILES > 3:
            _store_partial(partial_ptr, acc3, 3, pid_k, M, N, cols, ROWS, BLOCK_M, REDUCE)
        if REDUCE:
            # acq_rel: this slice's partials are visible to whoever sees the counter move past it.
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT - 1:
                for tile in tl.static_range(TILES):
                    _sum_partials(partial_ptr, out_ptr, tile, M, N, pid_n, cols, u_ptr, stride_u, EPILOGUE, SPLIT,
                                  ROWS, BLOCK_M, BLOCK_N, CAP)
                tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _chunk_partial(q, k, v, visible, scaling):
    """One chunk's partial for a tile of query rows: scores, running max m, sum of exponentials l,
    unnormalized output acc. Both kinds of chunk call this, so a row's arithmetic is one code path."""
    scores = tl.dot(q, tl.trans(k)) * scaling
    scores = tl.where(visible, scores, -1.0e30)  # finite: a row with no visible key gets l = 0
    m = tl.max(scores, 1)
    p = tl.where(visible, tl.exp(scores - m[:, None]), 0.0)
    l = tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v)
    return m, l, acc


@triton.jit
def _step_span(start, T, S, SLIDING: tl.constexpr, BLOCK_S: tl.constexpr):
    """The chunks holding the slots a step of T rows starting at position `start` wrote: first
    chunk, number of chunks (full layers: slot = position; sliding: slot = position % S, the ring,
    so the span may wrap) and the number of chunks of the cache."""
    n_all = (S + BLOCK_S - 1) // BLOCK_S
    if SLIDING:
        first = (start % S) // BLOCK_S
        last = ((start + T - 1) % S) // BLOCK_S
        # a step that wraps past the ring's end covers first..n_all - 1 and 0..last, which on a ring of
        # fewer than about T + BLOCK_S slots whose last chunk is partial reaches back into `first`: every chunk
        wraps = (start % S) + T > S
        span = tl.where(wraps, tl.minimum(n_all - first + last + 1, n_all), last - first + 1)
    else:
        first = start // BLOCK_S
        span = (start + T - 1) // BLOCK_S - first + 1
    return first, span, n_all


@triton.jit
def _step_attention_partials(q_ptr, k_ptr, v_ptr, slot_pos_ptr, qpos_ptr, path_ptr, m_ptr, l_ptr, acc_ptr,
                             T, S, n_cache_chunks, n_own_chunks, window, scaling, stride_qt, stride_qh, stride_kh,
                             stride_ks, stride_pt, n_rows, n_chunks, nk_ptr, nv_ptr, stride_nkt, stride_nkh,
                             stride_nvt, stride_nvh,
                             G: tl.constexpr, D: tl.constexpr, SLIDING: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
                             WRITE: tl.constexpr = False):
    """Every chunk partial of a step, in one launch. Grid: (KV heads, R = query-row blocks,
    n_cache_chunks + n_own_chunks * ceil(T / R)). Program (kvh, a, c) with c < n_cache_chunks is a
    chunk the step did not write, for query-row block a (`_chunk_partials`); with o = c -
    n_cache_chunks it is the (o % n_own_chunks)-th chunk the step wrote into, for token
    a + R * (o // n_own_chunks) (`_own_partials`), so the T tokens' programs tile the row-block
    axis without idle ones. Programs with nothing to do (a token past the step, a chunk the step
    wrote or did not write, a chunk past the token's position on a full layer) return at once.
    Each program's arithmetic is what it was as one of two kernels, so the partials are the same
    bits (checked under Triton's interpreter on the 35 cases of tests/test_step_attention_interpreted.py);
    one launch instead of two per layer.

    WRITE: the step's own K/V rows (nk / nv [T, KV heads, D], row strides stride_nkt / stride_nvt, head
    strides stride_nkh / stride_nvh) are not in the cache yet: this launch writes them (row t at slot
    start + t, modulo the ring; the bits of index_copy_), and the programs of the chunks the step
    wrote read the step's positions from nk / nv, the rest from the cache. No program reads a slot
    this launch writes (those are the step's positions, read from nk / nv), so the keys are the
    ones a write before the launch would have left: the same partials, one launch less a layer."""
    _pdl_start(PDL)
    _step_program(q_ptr, k_ptr, v_ptr, slot_pos_ptr, qpos_ptr, path_ptr, m_ptr, l_ptr, acc_ptr,
                  tl.program_id(0), tl.program_id(1), tl.program_id(2), T, S, n_cache_chunks, n_own_chunks, window,
                  scaling, stride_qt, stride_qh, stride_kh, stride_ks, stride_pt, n_rows, n_chunks,
                  nk_ptr, nv_ptr, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
                  G, D, SLIDING, BLOCK_R, BLOCK_S, WRITE)


@triton.jit
def _step_attention_partials_segments(q_ptr, table_ptr, k_field, v_field, qpos_ptr, m_ptr, l_ptr, acc_ptr,
                                      kv_heads, T, S, n_cache_chunks, n_own_chunks, window, scaling, stride_qt,
                                      stride_qh, stride_kh, stride_ks, stride_pt, stride_table, n_rows, n_chunks,
                                      nk_ptr, nv_ptr, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
                                      SLOT_POS_FIELD: tl.constexpr, PATH_FIELD: tl.constexpr,
                                      G: tl.constexpr, D: tl.constexpr, SLIDING: tl.constexpr,
                                      BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
                                      WRITE: tl.constexpr = False):
    """`_step_attention_partials` of several sequences' steps of T rows each, in one launch. Grid:
    (segments x KV heads, R, as the lone kernel). Segment s owns query rows s*T.. of q and qpos
    and its scratch rows from s*T*G on; its caches, ring positions and tree paths are the
    addresses in row s of `table` (int64: fields k_field / v_field for this layer's K and V,
    SLOT_POS_FIELD, PATH_FIELD). Each program is the lone kernel's program on the segment's
    pointers, so a segment's partials are the bits of its step alone. WRITE: as the lone kernel's,
    segment s's new rows are rows s*T.. of nk / nv, written into its own caches."""
    _pdl_start(PDL)
    seg = tl.program_id(0) // kv_heads
    kvh = tl.program_id(0) % kv_heads
    row = table_ptr + seg * stride_table
    # Addresses read from memory carry no alignment the compiler can see (an argument's does: Triton
    # specializes it), so without these hints every K/V load would be one element wide. Torch's
    # allocations are aligned far past 16 bytes.
    k_ptr = tl.multiple_of(tl.load(row + k_field).to(tl.pointer_type(q_ptr.dtype.element_ty)), 16)
    v_ptr = tl.multiple_of(tl.load(row + v_field).to(tl.pointer_type(q_ptr.dtype.element_ty)), 16)
    slot_pos_ptr = tl.multiple_of(tl.load(row + SLOT_POS_FIELD).to(tl.pointer_type(tl.int64)), 16)
    path_ptr = tl.multiple_of(tl.load(row + PATH_FIELD).to(tl.pointer_type(tl.int64)), 16)
    first_row = seg * T * G  # scratch rows: (kvh * n_rows + r) * n_chunks + chunk, r counted from here
    _step_program(q_ptr + seg * T * stride_qt, k_ptr, v_ptr, slot_pos_ptr, qpos_ptr + seg * T, path_ptr,
                  m_ptr + first_row * n_chunks, l_ptr + first_row * n_chunks, acc_ptr + first_row * n_chunks * D,
                  kvh, tl.program_id(1), tl.program_id(2), T, S, n_cache_chunks, n_own_chunks, window,
                  scaling, stride_qt, stride_qh, stride_kh, stride_ks, stride_pt, n_rows, n_chunks,
                  nk_ptr + seg * T * stride_nkt, nv_ptr + seg * T * stride_nvt, stride_nkt, stride_nkh, stride_nvt,
                  stride_nvh, G, D, SLIDING, BLOCK_R, BLOCK_S, WRITE)


@triton.jit
def _step_program(q_ptr, k_ptr, v_ptr, slot_pos_ptr, qpos_ptr, path_ptr, m_ptr, l_ptr, acc_ptr, kvh, a, c,
                  T, S, n_cache_chunks, n_own_chunks, window, scaling, stride_qt, stride_qh, stride_kh,
                  stride_ks, stride_pt, n_rows, n_chunks, nk_ptr, nv_ptr, stride_nkt, stride_nkh, stride_nvt,
                  stride_nvh, G: tl.constexpr, D: tl.constexpr, SLIDING: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, WRITE: tl.constexpr):
    """Program (kvh, a, c) of `_step_attention_partials` (its docstring says what each does). With
    WRITE, the program of token t's first own chunk also writes t's K/V row of head kvh into the cache."""
    start = tl.load(qpos_ptr)  # the step's first position (row 0 is the root, depth 0)
    first, span, n_all = _step_span(start, T, S, SLIDING, BLOCK_S)
    if c < n_cache_chunks:  # row block a < R: its rows start before T * G
        if SLIDING:
            written = (c - first + n_all) % n_all < span
        else:  # chunks at or past the step's first slot: the step's own chunks, or masked for every row
            written = c >= first
        if not written:
            _chunk_partials(q_ptr, k_ptr, v_ptr, slot_pos_ptr, qpos_ptr, m_ptr, l_ptr, acc_ptr, kvh, a, c,
                            T, S, window, scaling, stride_qt, stride_qh, stride_kh, stride_ks, n_rows, n_chunks,
                            G, D, SLIDING, BLOCK_R, BLOCK_S)
    else:
        o = c - n_cache_chunks
        t = a + tl.num_programs(1) * (o // n_own_chunks)
        which = o % n_own_chunks
        if WRITE:
            if (t < T) & (which == 0):
                _write_own_row(k_ptr, v_ptr, nk_ptr, nv_ptr, kvh, t, start, S, stride_kh, stride_ks, stride_nkt,
                               stride_nkh, stride_nvt, stride_nvh, D, SLIDING)
        if (t < T) & (which < span):
            chunk = (first + which) % n_all
            qpos_t = tl.load(qpos_ptr + t)
            # full layers: chunks past this token's position are masked for its rows, the merge reads none
            if SLIDING:
                visible_chunk = True
            else:
                visible_chunk = chunk * BLOCK_S <= qpos_t
            if visible_chunk:
                _own_partials(q_ptr, k_ptr, v_ptr, slot_pos_ptr, path_ptr, m_ptr, l_ptr, acc_ptr, kvh, t, chunk,
                              qpos_t, start, T, S, window, scaling, stride_qt, stride_qh, stride_kh, stride_ks,
                              stride_pt, n_rows, n_chunks, nk_ptr, nv_ptr, stride_nkt, stride_nkh, stride_nvt,
                              stride_nvh, G, D, SLIDING, BLOCK_R, BLOCK_S, WRITE)


@triton.jit
def _write_own_row(k_ptr, v_ptr, nk_ptr, nv_ptr, kvh, t, start, S, stride_kh, stride_ks, stride_nkt, stride_nkh,
                   stride_nvt, stride_nvh, D: tl.constexpr, SLIDING: tl.constexpr):
    """Row t of a step starting at `start`: its K and V of head kvh into the cache at slot start + t
    (modulo the ring S on a sliding layer), where server/fast_path.py's index_copy_ put them."""
    slot = start + t
    if SLIDING:
        slot = slot % S
    d = tl.arange(0, D)
    at = kvh * stride_kh + slot * stride_ks + d
    tl.store(k_ptr + at, tl.load(nk_ptr + t * stride_nkt + kvh * stride_nkh + d))
    tl.store(v_ptr + at, tl.load(nv_ptr + t * stride_nvt + kvh * stride_nvh + d))


@triton.jit
def _chunk_partials(q_ptr, k_ptr, v_ptr, slot_pos_ptr, qpos_ptr, m_ptr, l_ptr, acc_ptr, kvh, rb, chunk,
                    T, S, window, scaling, stride_qt, stride_qh, stride_kh, stride_ks, n_rows, n_chunks,
                    G: tl.constexpr, D: tl.constexpr, SLIDING: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Partial softmax-attention of one KV head's query rows (row = token t * G + head g) over one
    chunk of BLOCK_S key slots that the step did not write (keys from before the step, the same for
    every row): running max m, sum of exponentials l, unnormalized output acc. The chunks the step
    wrote into are _own_partials', one token at a time."""
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    t = r // G
    row_ok = t < T
    qpos = tl.load(qpos_ptr + t, mask=row_ok, other=-1)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t[:, None] * stride_qt + (kvh * G + r % G)[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    s_idx = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s_idx < S
    k = tl.load(k_ptr + kvh * stride_kh + s_idx[:, None] * stride_ks + d[None, :], mask=s_ok[:, None], other=0.0)
    v = tl.load(v_ptr + kvh * stride_kh + s_idx[:, None] * stride_ks + d[None, :], mask=s_ok[:, None], other=0.0)
    if SLIDING:
        kp = tl.load(slot_pos_ptr + s_idx, mask=s_ok, other=-1)
        visible = (kp[None, :] <= qpos[:, None]) & (kp[None, :] > qpos[:, None] - window) & (kp[None, :] >= 0)
    else:
        visible = s_idx[None, :] <= qpos[:, None]
    visible = visible & s_ok[None, :]
    m, l, acc = _chunk_partial(q, k, v, visible, scaling)
    ml = (kvh * n_rows + r) * n_chunks + chunk
    tl.store(m_ptr + ml, m, mask=row_ok)
    tl.store(l_ptr + ml, l, mask=row_ok)
    tl.store(acc_ptr + ml[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _own_partials(q_ptr, k_ptr, v_ptr, slot_pos_ptr, path_ptr, m_ptr, l_ptr, acc_ptr, kvh, t, chunk, qpos_t,
                  start, T, S, window, scaling, stride_qt, stride_qh, stride_kh, stride_ks, stride_pt,
                  n_rows, n_chunks, nk_ptr, nv_ptr, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
                  G: tl.constexpr, D: tl.constexpr, SLIDING: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, WRITE: tl.constexpr):
    """A chunk the step wrote into, for one token t (its G query heads, padded to BLOCK_R rows):
    the same position-aligned chunks as a chain's, the step's keys gathered into them by depth.
    Column c of a chunk is the slot of one position p (full: p = slot; sliding: p = slot_pos[slot]);
    a position before the step's start s is read from its slot, a position s + j (0 <= j < T) from
    the slot of t's ancestor at depth j, row path[t, j] (its K/V sit at slot s + path[t, j], modulo
    the ring). The columns and the visibility rule are a chain row's (p <= qpos[t] = s + depth(t);
    sliding: also > qpos[t] - window), so a tree row's sum is its path's chain row's, bit for bit;
    for a chain path[t, j] = j and every column reads its own slot, as _chunk_partials would. With
    WRITE the step's positions are read from its new rows (row path[t, j] of nk / nv: what that slot
    holds once written), the other columns from the cache."""
    g = tl.arange(0, BLOCK_R)
    row_ok = g < G
    qpos = tl.where(row_ok, qpos_t, -1)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t * stride_qt + (kvh * G + g)[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    s_idx = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s_idx < S
    if SLIDING:
        kp = tl.load(slot_pos_ptr + s_idx, mask=s_ok, other=-1)
    else:
        kp = s_idx
    own = (kp >= start) & (kp < start + T) & s_ok
    j = tl.minimum(tl.maximum(kp - start, 0), T - 1)
    row = tl.load(path_ptr + t * stride_pt + j, mask=own, other=0)
    if WRITE:  # each column's row address picked first: one load a tile (two tiles then a select spilled)
        k_rows = tl.where(own, nk_ptr + row * stride_nkt + kvh * stride_nkh, k_ptr + kvh * stride_kh + s_idx * stride_ks)
        v_rows = tl.where(own, nv_ptr + row * stride_nvt + kvh * stride_nvh, v_ptr + kvh * stride_kh + s_idx * stride_ks)
        k = tl.load(k_rows[:, None] + d[None, :], mask=s_ok[:, None], other=0.0)
        v = tl.load(v_rows[:, None] + d[None, :], mask=s_ok[:, None], other=0.0)
    else:  # the step's positions from the slots the step wrote them to
        src = start + row
        if SLIDING:
            src = src % S
        src = tl.where(own, src, s_idx)
        k = tl.load(k_ptr + kvh * stride_kh + src[:, None] * stride_ks + d[None, :], mask=s_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kvh * stride_kh + src[:, None] * stride_ks + d[None, :], mask=s_ok[:, None], other=0.0)
    if SLIDING:
        visible = (kp[None, :] <= qpos[:, None]) & (kp[None, :] > qpos[:, None] - window) & (kp[None, :] >= 0)
    else:
        visible = s_idx[None, :] <= qpos[:, None]
    visible = visible & s_ok[None, :]
    m, l, acc = _chunk_partial(q, k, v, visible, scaling)
    r = t * G + g
    ml = (kvh * n_rows + r) * n_chunks + chunk
    tl.store(m_ptr + ml, m, mask=row_ok)
    tl.store(l_ptr + ml, l, mask=row_ok)
    tl.store(acc_ptr + ml[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _step_attention_combine(m_ptr, l_ptr, acc_ptr, qpos_ptr, out_ptr, stride_ot, n_rows, n_chunks, n_used,
                            G: tl.constexpr, D: tl.constexpr, SLIDING: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """One query row: merge its chunks' partials in chunk order (a fixed order) into out[t, head]."""
    _pdl_start(PDL)
    kvh = tl.program_id(0)
    r = tl.program_id(1)
    t = r // G
    last = _last_chunk(qpos_ptr, t, n_used, SLIDING, BLOCK_S)
    _store_merged_row(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ot, kvh, t, r % G, last, n_rows, n_chunks, n_used, G, D)


@triton.jit
def _last_chunk(qpos_ptr, t, n_used, SLIDING: tl.constexpr, BLOCK_S: tl.constexpr):
    """The last chunk token t's rows read: the cache's last (sliding), or its position's (full)."""
    if SLIDING:
        last = n_used - 1
    else:
        last = tl.minimum(tl.load(qpos_ptr + t) // BLOCK_S, n_used - 1)
    return last


@triton.jit
def _store_merged_row(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ot, kvh, t, g, last, n_rows, n_chunks, n_used,
                      G: tl.constexpr, D: tl.constexpr):
    """out[t, head kvh * G + g] = row t * G + g's chunk partials 0..last merged in chunk order (a fixed
    order). Compiled, the loops run to `last`; under the interpreter (`_MERGE_TO_ARGUMENT`) to n_used,
    the chunks past `last` masked, which changes no value.

    Latency, not arithmetic, is what a merge costs: a loop that reads a chunk's partials and then uses
    them waits one memory round trip a chunk. So the maxima are read MERGE_MAX_BLOCK chunks at a time
    (a maximum is exact in any order), and the sums' loop reads four chunks' partials before it adds
    the first of them, then adds them one by one in chunk order: the same operations in the
    same order as a chunk at a time, so the same bits (E4B shape on an H100: the 8- and 32-token
    steps' logits hash alike before and after, in `python -m bench.step_ab --rows 8 32`). The 42
    merges of a one-token step took 0.110 ms before and 0.100-0.101 after, a 16-token verify's 0.123
    and 0.108-0.111 (that bench's kernel timelines with RING_PAIR off, one process before against six
    after: bench/results/step_ab-merge-base-h100.md and the runs it names; with RING_PAIR on, three
    processes, 0.101-0.102 and 0.116)."""
    base = (kvh * n_rows + t * G + g) * n_chunks
    if _MERGE_TO_ARGUMENT:
        end = n_used
    else:
        end = last + 1
    block = tl.arange(0, MERGE_MAX_BLOCK)
    m_max = -1.0e30
    for c0 in range(0, end, MERGE_MAX_BLOCK):
        c = c0 + block
        m_max = tl.maximum(m_max, tl.max(tl.load(m_ptr + base + c, mask=c <= last, other=-1.0e30), axis=0))
    d = tl.arange(0, D)
    total = tl.zeros((D,), dtype=tl.float32)
    denom = 0.0
    for c0 in range(0, end, 4):
        live0, live1, live2, live3 = c0 <= last, c0 + 1 <= last, c0 + 2 <= last, c0 + 3 <= last
        a0 = tl.load(acc_ptr + (base + c0) * D + d, mask=live0, other=0.0)
        a1 = tl.load(acc_ptr + (base + c0 + 1) * D + d, mask=live1, other=0.0)
        a2 = tl.load(acc_ptr + (base + c0 + 2) * D + d, mask=live2, other=0.0)
        a3 = tl.load(acc_ptr + (base + c0 + 3) * D + d, mask=live3, other=0.0)
        w0 = tl.exp(tl.load(m_ptr + base + c0, mask=live0, other=0.0) - m_max)
        w1 = tl.exp(tl.load(m_ptr + base + c0 + 1, mask=live1, other=0.0) - m_max)
        w2 = tl.exp(tl.load(m_ptr + base + c0 + 2, mask=live2, other=0.0) - m_max)
        w3 = tl.exp(tl.load(m_ptr + base + c0 + 3, mask=live3, other=0.0) - m_max)
        l0 = tl.load(l_ptr + base + c0, mask=live0, other=0.0)
        l1 = tl.load(l_ptr + base + c0 + 1, mask=live1, other=0.0)
        l2 = tl.load(l_ptr + base + c0 + 2, mask=live2, other=0.0)
        l3 = tl.load(l_ptr + base + c0 + 3, mask=live3, other=0.0)
        denom = tl.where(live0, denom + w0 * l0, denom)
        total = tl.where(live0, total + w0 * a0, total)
        denom = tl.where(live1, denom + w1 * l1, denom)
        total = tl.where(live1, total + w1 * a1, total)
        denom = tl.where(live2, denom + w2 * l2, denom)
        total = tl.where(live2, total + w2 * a2, total)
        denom = tl.where(live3, denom + w3 * l3, denom)
        total = tl.where(live3, total + w3 * a3, total)
    tl.store(out_ptr + t * stride_ot + (kvh * G + g) * D + d, (total / denom).to(out_ptr.dtype.element_ty))


@triton.jit
def _dequant_kernel(w_ptr, scale_ptr, offset_ptr, out_ptr, N, BLOCK_N: tl.constexpr):
    """W^T [K, N] (row-major, out's dtype) of one int4 weight in server/small_m_matmul.py's layout,
    one (group of 128 input features, BLOCK_N columns) per program: W = code * scale + offset,
    computed in fp32 and rounded once (code * scale is exact in fp32: a 4-bit code times an 8-bit
    mantissa, so a fused multiply-add rounds the same as a multiply then an add)."""
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    sub = tl.arange(0, 16)
    packed = tl.load(w_ptr + (group * 16 + sub[:, None]) * N + cols[None, :])
    scale = tl.load(scale_ptr + group * N + cols).to(tl.float32)[None, :]
    offset = tl.load(offset_ptr + group * N + cols).to(tl.float32)[None, :]
    for j in tl.static_range(8):
        code = ((packed >> (4 * j)) & 0xF).to(tl.float32)
        rows = group * 128 + 16 * j + sub
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], (code * scale + offset).to(out_ptr.dtype.element_ty))


@triton.jit
def _write_slot_pos_segments(table_ptr, wpos_ptr, ring_slot_ptr, T, stride_table, SLOT_POS_FIELD: tl.constexpr, PDL: tl.constexpr = False):
    """Stacked steps (server/batch_step.py): row r of segment r // T wrote position wpos[r] at ring
    slot ring_slot[r]; record it in that segment's ring positions (its table row's SLOT_POS_FIELD)."""
    _pdl_start(PDL)
    r = tl.program_id(0)
    slot_pos = tl.load(table_ptr + (r // T) * stride_table + SLOT_POS_FIELD).to(tl.pointer_type(tl.int64))
    tl.store(slot_pos + tl.load(ring_slot_ptr + r), tl.load(wpos_ptr + r))


# Positions change with every prompt: not specialized on (a compilation per divisibility pattern
# otherwise); S is, so rows of a multiple of 16 keys load in wide vectors.
@triton.jit(do_not_specialize=["t", "first_q", "key0", "window"])
def _prefill_softmax_kernel(s_ptr, out_ptr, S, t, first_q, key0, window, scaling, BLOCK: tl.constexpr):
    """One row of prefill attention's probabilities (server/fast_prefill.py `_attend`): scores
    [rows, S] (bf16, row r the query at position first_q + r % t) against keys at positions
    key0..key0+S-1; key c visible when key0 + c <= the query's position and, with a window, > it
    minus the window. probs = softmax(scores * scaling) over the visible keys, 0 elsewhere, in
    fp32, written rounded to out's dtype. One pass keeps the running max and sum (online softmax),
    a second writes; the order of the row's sums is fixed (deterministic). Every row sees at least
    its own key (the caller's invariant), so the sum is never 0."""
    row = tl.program_id(0)
    qp = first_q + row % t
    base = row.to(tl.int64) * S
    lo = 0
    if window > 0:
        lo = tl.maximum(qp - window + 1 - key0, 0)
    hi = tl.minimum(qp - key0 + 1, S)   # keys lo..hi-1 are visible
    cols = tl.arange(0, BLOCK)
    m = tl.full((), -1.0e30, tl.float32)
    l = tl.zeros((), tl.float32)
    for c0 in range((lo // BLOCK) * BLOCK, hi, BLOCK):
        c = c0 + cols
        vis = (c >= lo) & (c < hi)
        x = tl.where(vis, tl.load(s_ptr + base + c, mask=vis, other=0.0).to(tl.float32) * scaling, -1.0e30)
        m_new = tl.maximum(m, tl.max(x, 0))
        l = l * tl.exp(m - m_new) + tl.sum(tl.where(vis, tl.exp(x - m_new), 0.0), 0)
        m = m_new
    inv = 1.0 / l
    for c0 in range(0, S, BLOCK):
        c = c0 + cols
        vis = (c >= lo) & (c < hi)
        x = tl.load(s_ptr + base + c, mask=vis, other=0.0).to(tl.float32) * scaling
        p = tl.where(vis, tl.exp(x - m) * inv, 0.0)
        tl.store(out_ptr + base + c, p.to(out_ptr.dtype.element_ty), mask=c < S)


@triton.jit
def _gather_rows(table_ptr, ids_ptr, out_ptr, scale, width, n_rows, stride_table, stride_out,
                 HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = table[ids[r]] (times `scale` where HAS_SCALE, computed in fp32 and rounded once to
    out's dtype, as torch multiplies a bf16 tensor by a bf16 scalar), BLOCK columns a program. The
    table may be host memory the GPU reads in place (server/host_rows.py): each program's loads
    are one PCIe round trip, all of a row's programs in flight at once. An id outside the table's
    n_rows reads nothing and gives a row of zeros: the kernel never reads past the table (the
    server refuses such ids before they get here; this keeps a bug from reading host memory)."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(ids_ptr + r).to(tl.int64)   # E4B's per-layer table spans 2.8e9 elements: 64-bit offsets
    inside = cols < width
    x = tl.load(table_ptr + row * stride_table + cols, mask=inside & (row >= 0) & (row < n_rows), other=0.0)
    if HAS_SCALE:
        x = (x.to(tl.float32) * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * stride_out + cols, x, mask=inside)


@triton.jit
def _summed_residual_norm(p_ptr, res_ptr, w_ptr, scalar_ptr, w_next_ptr, h_ptr, x_ptr, N, stride_ps, stride_pm,
                          stride_rm, stride_hm, stride_xm, eps, eps_next, SLICES: tl.constexpr,
                          HAS_W: tl.constexpr, HAS_SCALAR: tl.constexpr, NEXT: tl.constexpr,
                          HAS_W_NEXT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row of server/step_norms.py's residual norm: y = the row's K-slice partials summed in
    slice order and rounded once to the output's dtype; h = residual + RMSNorm(y) * w [* scalar];
    with NEXT also x = RMSNorm(h) * w_next. Every value rounded to the output's dtype where
    transformers' modules round it (fast_ops' `_residual_norm`); the whole row stays in registers,
    so the partials are read once."""
    _pdl_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    out_ty = h_ptr.dtype.element_ty
    y = _summed_slices_at(p_ptr + row * stride_pm, stride_ps, cols, inside, SLICES).to(out_ty).to(tl.float32)
    n = y * (1.0 / tl.sqrt_rn(tl.sum(y * y, axis=0) / N + eps))
    if HAS_W:
        n = n * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    residual = tl.load(res_ptr + row * stride_rm + cols, mask=inside, other=0.0).to(tl.float32)
    h = (residual + n.to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    if HAS_SCALAR:
        h = (h * tl.load(scalar_ptr).to(tl.float32)).to(out_ty).to(tl.float32)
    tl.store(h_ptr + row * stride_hm + cols, h.to(out_ty), mask=inside)
    if NEXT:
        x = h * (1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / N + eps_next))
        if HAS_W_NEXT:
            x = x * tl.load(w_next_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(x_ptr + row * stride_xm + cols, x.to(out_ty), mask=inside)


@triton.jit
def _summed_slices_at(p_ptr, stride_ps, cols, inside, SLICES: tl.constexpr):
    """fp32 sum, in slice order from the first, of the K-slice partials at p_ptr + cols (0 where not
    `inside`)."""
    y = tl.load(p_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SLICES):
        y = y + tl.load(p_ptr + s * stride_ps + cols, mask=inside, other=0.0).to(tl.float32)
    return y


@triton.jit
def _head_norm_rope(p_ptr, stride_ps, w_ptr, eps, cos_ptr, sin_ptr, out_ptr, D: tl.constexpr,
                    SLICES: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr):
    """One head of one row: its partials (at p_ptr) summed and rounded to the output's dtype,
    RMSNorm over the head [* w], rounded; with ROPE also rotated: x * cos + rotate_half(x) * sin,
    written with each product and the sum rounded as transformers computes it in the model's dtype,
    which the compiler contracts so that one product and the sum are one bf16 fma (fma.rn.bf16x2 in
    the sm_90 PTX): one rounding short of transformers', the same for every row."""
    out_ty = out_ptr.dtype.element_ty
    cols = tl.arange(0, D)
    whole = cols < D   # every column: a head is D values
    y = _summed_slices_at(p_ptr, stride_ps, cols, whole, SLICES).to(out_ty).to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(y * y, axis=0) / D + eps)
    n = y * inv
    if HAS_W:
        n = n * tl.load(w_ptr + cols).to(tl.float32)
    n = n.to(out_ty).to(tl.float32)
    if ROPE:
        # rotate_half(n)[c] = -n[c + D/2] for c < D/2, n[c - D/2] after: the other half's partials,
        # summed and rounded as n's own (negation is exact and rounding symmetric, so the sign after)
        other = (cols + D // 2) % D
        r = _summed_slices_at(p_ptr, stride_ps, other, whole, SLICES).to(out_ty).to(tl.float32) * inv
        if HAS_W:
            r = r * tl.load(w_ptr + other).to(tl.float32)
        r = tl.where(cols < D // 2, -r, r).to(out_ty).to(tl.float32)
        a = (n * tl.load(cos_ptr + cols).to(tl.float32)).to(out_ty).to(tl.float32)
        b = (r * tl.load(sin_ptr + cols).to(tl.float32)).to(out_ty).to(tl.float32)
        n = a + b
    tl.store(out_ptr + cols, n.to(out_ty))


@triton.jit
def _summed_qkv_norm_rope(pq_ptr, pk_ptr, pv_ptr, wq_ptr, wk_ptr, wv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                          stride_ps, stride_pt, stride_cos, stride_sin, eps_q, eps_k, eps_v, H, KVH,
                          D: tl.constexpr, SLICES: tl.constexpr, HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr,
                          HAS_WV: tl.constexpr, PDL: tl.constexpr = False):
    """server/step_norms.py's q / k / v norms of one attention layer: program (t, j) does row t's
    head j, of q (j < H: normed, rotated), k (normed, rotated) or v (normed) after it. The heads of
    a row's partials sit D apart; q, k and v are written [T, heads, D]."""
    _pdl_start(PDL)
    t = tl.program_id(0)
    j = tl.program_id(1)
    cos_row, sin_row = cos_ptr + t * stride_cos, sin_ptr + t * stride_sin
    if j < H:
        _head_norm_rope(pq_ptr + t * stride_pt + j * D, stride_ps, wq_ptr, eps_q, cos_row, sin_row,
                        q_ptr + (t * H + j) * D, D, SLICES, HAS_WQ, True)
    elif j < H + KVH:
        _head_norm_rope(pk_ptr + t * stride_pt + (j - H) * D, stride_ps, wk_ptr, eps_k, cos_row, sin_row,
                        k_ptr + (t * KVH + j - H) * D, D, SLICES, HAS_WK, True)
    else:
        _head_norm_rope(pv_ptr + t * stride_pt + (j - H - KVH) * D, stride_ps, wv_ptr, eps_v, cos_row, sin_row,
                        v_ptr + (t * KVH + j - H - KVH) * D, D, SLICES, HAS_WV, False)
