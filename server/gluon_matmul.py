"""The int4 step matmul in Gluon (Triton's lower-level language): the same products as
server/gpu_kernels.py `_small_m_kernel` with its int4 weights, bit for bit, with the operands'
movement written out instead of left to Triton's pipeliner.

Contract: `int4_step_matmul[grid](...)` takes `_small_m_kernel`'s arguments for an int4 weight in
server/small_m_matmul.py's layout (BLOCK_N = 64 or 128 columns a program, 2 to 8 warps:
`TILINGS`; K slices of whole 128-feature groups, split-K partials summed in slice order by the last
program of a column tile), its EPILOGUE included (the gelus fused into the store: server/gpu_kernels.py
`_small_m_kernel`), and writes the same output bits: each row tile's group sum is the eight m16n8k16 tensor-core products of the
group's 16-feature slices, in slice order, from zero, then added to the running sum, and each
weight is decoded by the same bf16 operations (0x4300 | code as bf16, minus 128, times the scale
plus the offset). `runs_on(device)` says whether it can run there (CUDA, compute capability 8.0
or later, a Triton with Gluon, not the interpreter); server/small_m_matmul.py launches it there
for int4 weights and `_small_m_kernel` elsewhere.

What differs is how the operands move and how the codes are unpacked. Both kernels copy a group's
operands into shared memory ahead of its products (cp.async). Triton's pipeliner copies x slice by
slice, in 4-byte pieces, with a barrier per slice (36 copy instructions and 5 barriers a group at one
row tile, in the sm_90 PTX). Here one ring of STAGES buffers receives, STAGES - 1 groups ahead,
everything a group needs: its [16, 64] weight words and x's rows for its 128 features in 16-byte
pieces (zero-filled past the last row), and its 64 scales and offsets (12 copy instructions, 3
barriers). In launches of one row tile x's pieces are 8 bytes and go through L1 (`X_VIA_L1_ROWS`),
where the other programs on the SM find them (16 copy instructions). The products read x's slices
from the ring with ldmatrix. A thread holds a column's words in pairs (features k and k + 1), and
`_slice_codes` turns a pair's nibbles of one slice into the mma operand's bf16x2 register (128 +
code, two weights) with one byte permute and one LOP3, where the per-element form (shift, mask,
16-bit conversion, OR, then packing) took about nine integer instructions a pair; the bf16
arithmetic after it (minus 128, times the scale plus the offset) is the same instructions
(tests/test_gluon_matmul_ptx.py).

With `RING_PAIR` (on; STAGES 2) the ring's two slots are allocations of their own and the loop takes
two groups a pass: one barrier a group instead of two.

Launch: with programmatic dependent launch (server/small_m_matmul.py `pdl_launch`) the kernel starts
while the one before it runs. Its first group's weight words, scales and offsets are read-only, so
`PREFETCH` copies them before waiting for that kernel; x and the epilogue's u (earlier kernels'
outputs), the split-K partials and the counters (scratch the kernels share) are touched only after,
each through a value the wait returns (`_wait_prior`). On a chain of
E4B's int4 matmuls over 42 layers of cold weights this took 0.12 ms off a forward's 2.16 at one row
(`python -m bench.small_m_bench --chain`).

Why the decoding matters: at one row the kernel is not bound by its loads alone. Throwaway variants
on E4B's gate|up (cold weights, one row, H200): 20.8 us as shipped before the byte permutes, 17.2
with the decoding cut to a shift (wrong bits, for timing), 15.6 with neither decoding nor products
(copies only), 10.4 copies only with a ring of four (the floor is 7.0 at 4 TB/s); with the full
decoding a ring of three or four gave 19.9 and six 25.4. Measured, E4B's int4 shapes on cold
weights summed over a forward (`python -m bench.small_m_bench --cold`): 1.89 ms a one-row forward
against the Triton kernel's 2.36, 5.93 ms at 64 rows against 7.01, 16 and 32 rows level (2.57
against 2.58, 3.71 against 3.75), every output bit-identical to `_small_m_kernel`'s at every row
count. A whole one-token step: 3.69 ms against 3.93 before the byte permutes, plain decode 236.5 ->
257.1 tokens/s (`python -m bench.step_ab`, README); the Gluon kernel's first version, against the
Triton kernel: 3.90 against 4.03.
"""
from __future__ import annotations

import os

import torch

try:  # Gluon ships with Triton 3.5+; without it the step matmul stays on `_small_m_kernel`
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp, mma_v2
    HAS_GLUON = True
except ImportError:
    HAS_GLUON = False

# Groups in flight: deeper rings took more shared memory for no gain (README); in whole steps too (an
# H100, one round of `python -m bench.step_ab --base-tree . --base-set server.gluon_matmul.STAGES=2
# --head-set server.gluon_matmul.STAGES=3 --rows 8`, bench/results/step_ab-stages3-h100.md): a
# one-token step 3.39 -> 3.47 ms, an 8-token step 3.66 -> 3.68, a 16-token verify 4.08 -> 4.10.
STAGES = 2
# The first groups' weights copied before waiting for the kernel before this one (PDL only; False: after
# it, A/B runs). Measured on the H200, E4B's six int4 matmuls a layer chained over 42 layers of cold
# weights, one process, modes alternating (a throwaway script): 2.157 -> 2.032 ms at 1 row, 3.368 ->
# 3.252 at 16, 4.096 -> 3.981 at 32, the same bits; L2 prefetches of the program's whole K slice on
# top of it were slower (2.244 / 3.456 / 4.144 ms).
PREFETCH = True
# x's copies go through L1 (cp.async.ca, in 8-byte pieces: Triton copies 16-byte pieces around L1) in
# launches of at most X_VIA_L1_ROWS rows (one row tile); the weights, read once, stay 16-byte .cg.
# Every program of a launch copies the x rows of its K slice, so the programs an SM holds share them
# through L1 instead of each fetching them from L2: what a 16-row launch paid over a one-row one (the
# profile in docs/bars.md, 12-07). The same bits either way (tests/test_step_kernel_rows.py). On an
# H100, three runs of `python -m bench.step_ab --base-tree . --base-set
# server.gluon_matmul.X_VIA_L1_ROWS=0 --head-set server.gluon_matmul.X_VIA_L1_ROWS=16` (one round
# each; bench/results/step_ab-x-l1-h100.md): a 16-token verify 3.88-3.89 -> 3.62-3.63 ms, an
# 8-token step 3.43 -> 3.29, a one-token step 3.15-3.16 -> 3.12, chained plain decode 317.4-317.7
# -> 322.1-323.4 tokens/s. With two row tiles or more (32 and 64 rows) x through L1 was slower
# (4.58 -> 4.72 and 6.87 -> 7.17 ms; twice the copy instructions for twice the rows): 0 for never.
X_VIA_L1_ROWS = 16
# The ring's two slots (STAGES 2) as two allocations, the loop taking two groups a pass, so that the
# copies into one slot and the reads of the other touch different allocations. Why: a one-row launch
# is bound by each warp's serial instruction stream (Nsight Compute, stop 64: 5.3 cycles an issued
# instruction, 0.7 of them at barriers), and with one ring allocation the compiler puts a second
# barrier in every group (the copies into one slot and the reads of another look like a hazard to
# it). Stop 68's W_DIRECT (the weights loaded straight into the mma's registers, x alone in two
# buffers: one barrier a group too, 237 instructions a group against 250, but 118 registers a thread
# against 68) was slower and is gone (docs/bars.md); this keeps the ring's registers and drops only
# the barrier (sm_90a: one barrier and about 233 instructions a group against two and 250; 88
# registers against 68 at one row tile). Measured, `python -m bench.step_ab --base-tree . --base-set
# server.gluon_matmul.RING_PAIR=False --head-set server.gluon_matmul.RING_PAIR=True --rounds 1 --reps
# 100 --rows 8 32`, three runs on an H100 (bench/results/step_ab-ring-pair-h100.md): the int4 matmuls'
# GPU time in a one-token step 1.727-1.731 -> 1.695-1.697 ms and in a 16-token verify 2.109-2.127 ->
# 2.032-2.047, chained plain decode 321.4-322.5 -> 324.9-326.1 tokens/s, a verify 3.61-3.62 -> 3.54-3.60
# ms, a 32-token step 4.56-4.57 -> 4.43-4.48, a one-token step 3.13 -> 3.09-3.15; one run on an H200
# (step_ab-ring-pair-h200.md): the matmuls 1.717 -> 1.675 ms, chained decode 333.1 -> 337.0. The same
# logits' bits at 8 and 32 rows in all four, and drafted equals plain.
RING_PAIR = True
BLOCK_N = 64        # output columns a program, as `_small_m_kernel`'s int4 configuration
NUM_WARPS = 4
# (columns a program, warps) the kernel is written for. The accumulator's layout gives each warp 8
# columns in every 8 x warps, so a warp takes BLOCK_N / warps columns: 16 in the first two, 32 in the
# last two, where each x slice a warp reads from shared memory (ldmatrix) feeds four products instead
# of two (at 64 rows the x reads, four row tiles a slice, outweigh the weights'). A column's sums do
# not depend on the tile it is in or on the warp that computes it, so the tilings give the same bits
# for the same K slices (tests/test_step_kernel_rows.py).
TILINGS = ((BLOCK_N, NUM_WARPS), (2 * BLOCK_N, 2 * NUM_WARPS), (BLOCK_N, NUM_WARPS // 2), (2 * BLOCK_N, NUM_WARPS))


def runs_on(device: torch.device) -> bool:
    """Whether `int4_step_matmul` can run on `device` (cp.async and mma.sync need sm_80+)."""
    if not HAS_GLUON or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def x_rows(tiles: int) -> int:
    """Rows of x a ring buffer holds for `tiles` row tiles: shared buffers take power-of-two shapes."""
    return 1 << (tiles * 16 - 1).bit_length()


if HAS_GLUON:
    from triton.language.extra.cuda import gdc_launch_dependents

    from server.gpu_kernels import _add_group, _gelu   # Triton helpers: Gluon calls them as they are

    # prmt selectors: byte b of the first word into byte 0, byte b of the second word into byte 2
    _PAIR_SELECTOR = gl.constexpr(tuple(hex(b | b << 4 | (4 + b) << 8 | (4 + b) << 12) for b in range(4)))

    @gluon.jit
    def _wait_prior(PDL: gl.constexpr):
        """server/gpu_kernels.py `_pdl_start` (wait for the kernel before this one, then let the next
        one launch), returning 1 after the wait, for the reads that must follow it to depend on."""
        if PDL:
            ready = gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 1;", "=r", [], dtype=gl.int32,
                                              is_pure=False, pack=1)
            gdc_launch_dependents()
        else:
            ready = gl.to_tensor(1)
        return ready

    @gluon.jit
    def _columns(pid_n, N, EPILOGUE: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """The weight columns program pid_n computes, as server/gpu_kernels.py `_columns`: with
        GELU_PAIRS its tile's first half are gate columns and the second half their up columns."""
        c = gl.arange(0, BLOCK_N, layout=layout)
        if EPILOGUE == 1:
            return pid_n * (BLOCK_N // 2) + c % (BLOCK_N // 2) + (c // (BLOCK_N // 2)) * (N // 2)
        return pid_n * BLOCK_N + c

    @gluon.jit
    def _copy_weights(w_s, scale_s, offset_s, slot, w_ptr, scale_ptr, offset_ptr, k0, live, N, pid_n,
                      BLOCK_N: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr, EPILOGUE: gl.constexpr):
        """Start the asynchronous copies of the weight words, scales and offsets of the group at
        feature k0 into ring buffer `slot` (nothing when `live` is false). They are read-only: these
        copies may start before the kernel before this one has ended (`PREFETCH`)."""
        words = gl.arange(0, 16, layout=gl.SliceLayout(1, WL))
        cols = _columns(pid_n, N, EPILOGUE, BLOCK_N, gl.SliceLayout(0, WL))
        w_ptrs = w_ptr + (k0 // 8 + words)[:, None] * N + cols[None, :]
        cp.async_copy_global_to_shared(w_s.index(slot), w_ptrs, mask=gl.full([16, BLOCK_N], 1, gl.int1, WL) & live)
        at = (k0 // 128) * N + _columns(pid_n, N, EPILOGUE, BLOCK_N, SL)
        every = gl.full([BLOCK_N], 1, gl.int1, SL) & live
        cp.async_copy_global_to_shared(scale_s.index(slot), scale_ptr + at, mask=every)
        cp.async_copy_global_to_shared(offset_s.index(slot), offset_ptr + at, mask=every)

    @gluon.jit
    def _copy_x(x_s, slot, x_ptr, k0, live, M, stride_xm, XROWS: gl.constexpr, XL: gl.constexpr):
        """Start the asynchronous copies of x's rows for the group at feature k0 into ring buffer
        `slot`, then commit everything started since the last commit as one group (copies with `live`
        false copy nothing but still commit, so every iteration's wait counts the same)."""
        # x as [8 * XROWS, 16]: buffer row j * XROWS + r holds row r's features k0 + 16 j .. k0 + 16 j + 15
        xi = gl.arange(0, 8 * XROWS, layout=gl.SliceLayout(1, XL))
        xk = gl.arange(0, 16, layout=gl.SliceLayout(0, XL))
        row = xi % XROWS
        x_ptrs = x_ptr + k0 + ((xi // XROWS) * 16 + row * stride_xm)[:, None] + xk[None, :]
        cp.async_copy_global_to_shared(x_s.index(slot), x_ptrs, mask=(row < M)[:, None] & live)
        cp.commit_group()

    @gluon.jit
    def _slice_codes(words, byte: gl.constexpr):
        """128 + code, as bf16, of the nibble in bits 0-3 of byte `byte` of each weight word. A
        thread holds a column's words in pairs (features k and k + 1: the mma operand's k_width=2),
        and one byte permute and one LOP3 turn a pair into the operand's bf16x2 register, low half
        from the first word: two integer instructions for two weights, where the shifts, masks,
        16-bit conversions and ORs of the per-element form took nine (tests/test_gluon_matmul_ptx.py)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; prmt.b32 t, $1, $2, " + _PAIR_SELECTOR[byte] + "; "
            "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }",   # (t & 0x000F000F) | 0x43004300
            "=r,r,r", [words], dtype=gl.bfloat16, is_pure=True, pack=2)

    @gluon.jit
    def _group_products(xs, packed, scale, offset, acc0, acc1, acc2, acc3, TILES: gl.constexpr, XROWS: gl.constexpr,
                        BLOCK_N: gl.constexpr, ACC: gl.constexpr, A: gl.constexpr, XT: gl.constexpr):
        """One K group: its eight 16-feature slices decoded from `packed` (layout B) and multiplied by
        x's slices from `xs` (one ring buffer), summed from zero, then added to each row tile's sum."""
        g0 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        g1 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        g2 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        g3 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        high = packed >> 4      # the odd slices' nibbles moved to the bytes' low halves
        for j in gl.static_range(8):
            code = _slice_codes(high if j % 2 else packed, j // 2) - 128.0
            w = (code * scale + offset).to(XT)
            g0 = mma_v2(xs.slice(j * XROWS, 16, 0).load(A), w, g0)
            if TILES > 1:
                g1 = mma_v2(xs.slice(j * XROWS + 16, 16, 0).load(A), w, g1)
            if TILES > 2:
                g2 = mma_v2(xs.slice(j * XROWS + 32, 16, 0).load(A), w, g2)
            if TILES > 3:
                g3 = mma_v2(xs.slice(j * XROWS + 48, 16, 0).load(A), w, g3)
        return _add_group(acc0, acc1, acc2, acc3, g0, g1, g2, g3, TILES)

    @gluon.jit
    def _ring_group(i, n_groups, w_now, x_now, scale_now, offset_now, slot, w_next, x_next, scale_next, offset_next,
                    acc0, acc1, acc2, acc3, w_ptr, scale_ptr, offset_ptr, x_ptr, k_begin, ready, M, N, pid_n,
                    stride_xm, AHEAD: gl.constexpr, TILES: gl.constexpr, XROWS: gl.constexpr,
                    BLOCK_N: gl.constexpr, EPILOGUE: gl.constexpr, ACC: gl.constexpr, A: gl.constexpr,
                    B: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr, SL: gl.constexpr):
        """Group i: its copies into buffer `slot` of the `now` buffers waited for (the AHEAD - 1 groups
        after it may still be copying), group i + AHEAD's copies into buffer (i + AHEAD) % (the `next`
        buffers' slots) started (nothing past the last group), then group i's products. The ring passes
        one set of buffers as both; RING_PAIR passes its two allocations, swapped every group."""
        cp.wait_group(AHEAD - 1)    # this thread's copies of group i are done ...
        gl.thread_barrier()         # ... and every thread's, and nobody still reads the buffer refilled next
        ahead = i + AHEAD
        into = ahead % w_next.shape[0]
        _copy_weights(w_next, scale_next, offset_next, into, w_ptr, scale_ptr, offset_ptr, k_begin + ahead * 128,
                      ahead < n_groups, N, pid_n, BLOCK_N, WL, SL, EPILOGUE)
        _copy_x(x_next, into, x_ptr, k_begin + ahead * 128, (ahead < n_groups) & (ready != 0), M, stride_xm, XROWS, XL)
        packed = w_now.index(slot).load(B)
        scale = gl.expand_dims(scale_now.index(slot).load(gl.SliceLayout(0, B)), 0)
        offset = gl.expand_dims(offset_now.index(slot).load(gl.SliceLayout(0, B)), 0)
        return _group_products(x_now.index(slot), packed, scale, offset, acc0, acc1, acc2, acc3, TILES, XROWS,
                               BLOCK_N, ACC, A, x_ptr.dtype.element_ty)

    @gluon.jit
    def _store_tile(out_ptr, acc, tile, M, N, pid_n, cols, rows16, u_ptr, stride_u, ready, EPILOGUE: gl.constexpr,
                    BLOCK_N: gl.constexpr, ACC: gl.constexpr):
        """As server/gpu_kernels.py `_store_out`: y, gelu(gate) * up (GELU_PAIRS) or gelu(y) * u
        (GELU_TIMES), the same arithmetic. With GELU_PAIRS a thread holds column c and c + BLOCK_N / 2
        (the accumulator's layout repeats every 8 * warps columns), so the pairs split off in registers."""
        rows = tile * 16 + rows16
        ty = out_ptr.dtype.element_ty
        if EPILOGUE == 1:
            HALF: gl.constexpr = BLOCK_N // 2
            # out's offsets and rows laid out as the accumulator, then split alike: same layouts
            c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ACC))
            at = rows[:, None] * (N // 2) + (pid_n * HALF + c % HALF)[None, :]
            row_of = rows[:, None] + 0 * c[None, :]
            gate, up = _pairs(acc, BLOCK_N)
            at_gate, _ = _pairs(at, BLOCK_N)
            row_gate, _ = _pairs(row_of, BLOCK_N)
            y = _gelu(gate.to(ty).to(gl.float32)) * up.to(ty).to(gl.float32)
            gl.store(out_ptr + at_gate, y.to(ty), mask=(row_gate < M) & (ready != 0))
        else:
            live = (rows < M)[:, None] & (ready != 0)
            at = rows[:, None] * N + cols[None, :]
            if EPILOGUE == 2:
                times = gl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=live, other=0.0)
                y = _gelu(acc.to(ty).to(gl.float32)) * times.to(gl.float32)
                gl.store(out_ptr + at, y.to(ty), mask=live)
            else:
                gl.store(out_ptr + at, acc.to(ty), mask=live)

    @gluon.jit
    def _pairs(t, BLOCK_N: gl.constexpr):
        """[16, BLOCK_N] -> its first and its second half of columns, [16, BLOCK_N / 2] each."""
        return gl.split(gl.permute(gl.reshape(t, [16, 2, BLOCK_N // 2]), [0, 2, 1]))

    @gluon.jit
    def _store_partial_tile(partial_ptr, acc, tile, pid_k, M, N, cols, rows16, ready, ROWS: gl.constexpr,
                            REDUCE: gl.constexpr):
        """As `_small_m_kernel`'s `_store_partial`: padding rows neither written nor read back; a K
        slice's partials ROWS rows apart, or M (REDUCE False: [SPLIT, M, N], SmallMLinear.slices)."""
        rows = tile * 16 + rows16
        slice_rows = ROWS if REDUCE else M
        gl.store(partial_ptr + pid_k * slice_rows * N + rows[:, None] * N + cols[None, :], acc,
                 mask=(rows < M)[:, None] & (ready != 0))

    @gluon.jit
    def _sum_partial_tiles(partial_ptr, out_ptr, tile, M, N, pid_n, cols, rows16, u_ptr, stride_u, ready,
                           EPILOGUE: gl.constexpr, SPLIT: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                           ACC: gl.constexpr):
        """As `_small_m_kernel`'s `_sum_partials`: the K slices' partials added in slice order."""
        rows = tile * 16 + rows16
        offsets = rows[:, None] * N + cols[None, :]
        live = (rows < M)[:, None] & (ready != 0)
        total = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        for s in gl.static_range(SPLIT):
            total += gl.load(partial_ptr + s * ROWS * N + offsets, mask=live, other=0.0, cache_modifier=".cg")
        _store_tile(out_ptr, total, tile, M, N, pid_n, cols, rows16, u_ptr, stride_u, ready, EPILOGUE, BLOCK_N, ACC)

    @gluon.jit
    def _epilogue(acc0, acc1, acc2, acc3, partial_ptr, count_ptr, out_ptr, M, N, pid_n, pid_k, u_ptr, stride_u, ready,
                  SPLIT: gl.constexpr, TILES: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                  EPILOGUE: gl.constexpr, REDUCE: gl.constexpr, ACC: gl.constexpr):
        """A program's row tiles' sums out: stored (one K slice), or stored as its slice's partials and,
        with REDUCE, summed in slice order by the column tile's last slice to arrive (its counter)."""
        cols = _columns(pid_n, N, EPILOGUE, BLOCK_N, gl.SliceLayout(0, ACC))
        rows16 = gl.arange(0, 16, layout=gl.SliceLayout(1, ACC))
        if SPLIT == 1:
            _store_tile(out_ptr, acc0, 0, M, N, pid_n, cols, rows16, u_ptr, stride_u, ready, EPILOGUE, BLOCK_N, ACC)
            if TILES > 1:
                _store_tile(out_ptr, acc1, 1, M, N, pid_n, cols, rows16, u_ptr, stride_u, ready, EPILOGUE, BLOCK_N, ACC)
            if TILES > 2:
                _store_tile(out_ptr, acc2, 2, M, N, pid_n, cols, rows16, u_ptr, stride_u, ready, EPILOGUE, BLOCK_N, ACC)
            if TILES > 3:
                _store_tile(out_ptr, acc3, 3, M, N, pid_n, cols, rows16, u_ptr, stride_u, ready, EPILOGUE, BLOCK_N, ACC)
        else:
            _store_partial_tile(partial_ptr, acc0, 0, pid_k, M, N, cols, rows16, ready, ROWS, REDUCE)
            if TILES > 1:
                _store_partial_tile(partial_ptr, acc1, 1, pid_k, M, N, cols, rows16, ready, ROWS, REDUCE)
            if TILES > 2:
                _store_partial_tile(partial_ptr, acc2, 2, pid_k, M, N, cols, rows16, ready, ROWS, REDUCE)
            if TILES > 3:
                _store_partial_tile(partial_ptr, acc3, 3, pid_k, M, N, cols, rows16, ready, ROWS, REDUCE)
            if REDUCE:
                # Every warp's partials stored before one thread's release: the acq_rel atomic orders only
                # what its own thread wrote or saw, so the warps meet first (the Triton kernel's PTX has this
                # barrier; this kernel's had none until a review of the sm_90 PTX, stop 71).
                gl.thread_barrier()
                # acq_rel: this slice's partials are visible to whoever sees the counter move past it.
                arrived = gl.atomic_add(count_ptr + pid_n, ready, sem="acq_rel")   # ready: 1
                if arrived == SPLIT - 1:
                    for tile in gl.static_range(TILES):
                        _sum_partial_tiles(partial_ptr, out_ptr, tile, M, N, pid_n, cols, rows16, u_ptr, stride_u,
                                           ready, EPILOGUE, SPLIT, ROWS, BLOCK_N, ACC)
                    gl.atomic_xchg(count_ptr + pid_n, 0)

    @gluon.jit
    def int4_step_matmul(x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, count_ptr, out_ptr,
                         M, N, K, stride_xm, k_per_split, u_ptr, stride_u,
                         SPLIT: gl.constexpr, TILES: gl.constexpr, ROWS: gl.constexpr, XROWS: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr = False,
                         EPILOGUE: gl.constexpr = 0, PREFETCH: gl.constexpr = False, REDUCE: gl.constexpr = True,
                         X_L1: gl.constexpr = False, PAIRED: gl.constexpr = False):
        """y[:M] = x @ W^T for one (column tile, K slice); see the module docstring. ROWS = TILES * 16
        (the partials' rows a K slice), XROWS = x_rows(TILES). REDUCE False (split-K only;
        SmallMLinear.slices): each K slice stores its partial ([SPLIT, M, N] contiguous) and the
        program ends, out is not written (no counter, no fence, no sum): the next kernel sums them."""
        NW: gl.constexpr = gl.num_warps()
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=2)
        WL: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [NW, 1], [1, 0])     # 16-byte copies
        if X_L1:  # 8-byte pieces: Triton lowers them to cp.async.ca (through L1), 16-byte ones to .cg
            XL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [NW, 1], [1, 0])
        else:
            XL: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [NW, 1], [1, 0])
        SL: gl.constexpr = gl.BlockedLayout([2], [32], [NW], [0])
        W_SHARED: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])
        X_SHARED: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=4, max_phase=2, order=[1, 0])
        S_SHARED: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        if not PREFETCH:
            ready = _wait_prior(PDL)
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        gl.static_assert(not PAIRED or STAGES == 2, "RING_PAIR pairs a ring of two slots")
        # the ring: STAGES groups of weight words, x, scales and offsets (PAIRED: two of one group each)
        SLOTS: gl.constexpr = 1 if PAIRED else STAGES
        w_s = gl.allocate_shared_memory(gl.int32, [SLOTS, 16, BLOCK_N], W_SHARED)
        x_s = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [SLOTS, 8 * XROWS, 16], X_SHARED)
        scale_s = gl.allocate_shared_memory(scale_ptr.dtype.element_ty, [SLOTS, BLOCK_N], S_SHARED)
        offset_s = gl.allocate_shared_memory(scale_ptr.dtype.element_ty, [SLOTS, BLOCK_N], S_SHARED)
        if PAIRED:
            w_s1 = gl.allocate_shared_memory(gl.int32, [1, 16, BLOCK_N], W_SHARED)
            x_s1 = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [1, 8 * XROWS, 16], X_SHARED)
            scale_s1 = gl.allocate_shared_memory(scale_ptr.dtype.element_ty, [1, BLOCK_N], S_SHARED)
            offset_s1 = gl.allocate_shared_memory(scale_ptr.dtype.element_ty, [1, BLOCK_N], S_SHARED)
        n_groups = k_per_split // 128
        k_begin = pid_k * k_per_split
        # PREFETCH (with PDL this kernel starts while the one before it runs): the weights are read-only,
        # so the first groups' weight copies are issued before waiting for it; x, the partials and the
        # counters only after.
        # `ready` is 1 once the kernel before this one has ended: every read of what an earlier kernel
        # wrote (x, u) and every write to what it may still read (the shared partials, the counters)
        # depends on its value, so the compiler cannot move one above the wait (it did move copies).
        for s in gl.static_range(STAGES - 1):   # PAIRED: STAGES is 2, slot 0 is the first pair's
            weights_live = s < n_groups
            if not PREFETCH:
                weights_live = weights_live & (ready != 0)
            _copy_weights(w_s, scale_s, offset_s, s, w_ptr, scale_ptr, offset_ptr, k_begin + s * 128,
                          weights_live, N, pid_n, BLOCK_N, WL, SL, EPILOGUE)
        if PREFETCH:
            ready = _wait_prior(PDL)
        for s in gl.static_range(STAGES - 1):
            _copy_x(x_s, s, x_ptr, k_begin + s * 128, (s < n_groups) & (ready != 0), M, stride_xm, XROWS, XL)
        acc0 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        acc1 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        acc2 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        acc3 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        if PAIRED:
            # The ring's two slots in allocations of their own, the loop taking two groups a pass: the
            # copies into one and the reads of the other then touch different allocations, so the
            # compiler adds no barrier between them (in one allocation it puts a second one in every group).
            for i in range(0, n_groups, 2):
                acc0, acc1, acc2, acc3 = _ring_group(
                    i, n_groups, w_s, x_s, scale_s, offset_s, 0, w_s1, x_s1, scale_s1, offset_s1, acc0, acc1, acc2,
                    acc3, w_ptr, scale_ptr, offset_ptr, x_ptr, k_begin, ready, M, N, pid_n, stride_xm, 1, TILES,
                    XROWS, BLOCK_N, EPILOGUE, ACC, A, B, WL, XL, SL)
                if i + 1 < n_groups:
                    acc0, acc1, acc2, acc3 = _ring_group(
                        i + 1, n_groups, w_s1, x_s1, scale_s1, offset_s1, 0, w_s, x_s, scale_s, offset_s, acc0, acc1,
                        acc2, acc3, w_ptr, scale_ptr, offset_ptr, x_ptr, k_begin, ready, M, N, pid_n, stride_xm, 1,
                        TILES, XROWS, BLOCK_N, EPILOGUE, ACC, A, B, WL, XL, SL)
        else:
            for i in range(0, n_groups):
                acc0, acc1, acc2, acc3 = _ring_group(
                    i, n_groups, w_s, x_s, scale_s, offset_s, i % STAGES, w_s, x_s, scale_s, offset_s, acc0, acc1,
                    acc2, acc3, w_ptr, scale_ptr, offset_ptr, x_ptr, k_begin, ready, M, N, pid_n, stride_xm,
                    STAGES - 1, TILES, XROWS, BLOCK_N, EPILOGUE, ACC, A, B, WL, XL, SL)
        cp.wait_group(0)
        _epilogue(acc0, acc1, acc2, acc3, partial_ptr, count_ptr, out_ptr, M, N, pid_n, pid_k, u_ptr, stride_u, ready,
                  SPLIT, TILES, ROWS, BLOCK_N, EPILOGUE, REDUCE, ACC)
