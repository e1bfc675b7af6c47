"""The int4 step matmul with its copies on a warp of their own: server/gluon_matmul.py's products,
decoding and epilogues, bit for bit, fed by a producer warp through a deeper ring (Hopper: TMA
and mbarriers).

Contract: `int4_step_matmul_ws[grid](...)` takes `int4_step_matmul`'s arguments for the tiling of
64 columns on 4 warps (TILINGS[0]), with the weight words, scales and offsets as TMA descriptors
(`descriptors(weight, scale, offset, pairs)`) in place of their pointers, and writes the same outputs:
each column's group sums are the same eight m16n8k16 products of the same decoded weights, added
in the same order (the 4 consumer warps hold the columns `int4_step_matmul`'s 4 warps hold, in the
same accumulator layout), so every output bit, partial and counter is that kernel's. `runs_on(device)`
says whether it can run there (CUDA, compute capability 9.0 or later, a Triton with Gluon's TMA).

What differs is who moves the operands. In `int4_step_matmul` the four warps that decode and
multiply also issue every copy (the weights' and x's cp.async, their addresses, the commits and
waits) and meet at a barrier every group. Stop 64's profile of a one-row gate|up put a warp at 5.3
cycles an issued instruction, 0.9 of them waiting on the copies and 0.7 at barriers, with 2.4
programs an SM; deeper cp.async rings and more warps did not pay (docs/bars.md), since each added
copy instructions, addresses or barriers to the same warps. Here one producer warp issues a group's
weight words, scales and offsets as four TMA bulk copies (one thread, no per-thread addresses) and
x's rows as cp.async that arrive on the same mbarrier (`cp.async.mbarrier.arrive.noinc`), STAGES
groups ahead; the consumer warps wait on a slot's "full" barrier, decode and multiply, and release
it on its "empty" barrier. Gluon syncs the four consumer warps before each mbarrier wait and each
arrive (two barriers a group among them, none with the producer; separate allocations a slot did
not remove them). The weights' shared tile is TMA's 128-byte swizzle (two
boxes of 32 columns a group: plain, the tile's two halves; with GELU_PAIRS, the gate half and the
up half, as `_columns` maps them); a group's scales and its offsets are one 128-byte box each (a
box's shared destination must be 128-byte aligned).

Registers: a warp-specialized CTA is 8 warps (the producer's warp group is padded to 4, the idle
three give their registers back by setmaxnreg), so `MAXNREG` caps the kernel's registers a thread
at launch: 80 x 256 threads (one or two row tiles) leaves three CTAs an SM, which a one-row
gate|up's 320 programs need (2.4 an SM) to be resident at once.

Launch: with programmatic dependent launch, the producer copies the first STAGES groups' weights
(read-only) before waiting for the kernel before this one, x only after; the consumers wait for it
before their first store (outputs, partials, counters).
"""
from __future__ import annotations

import torch

from server import gluon_matmul

try:  # TMA and mbarriers for Hopper in Gluon (Triton 3.5+)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAS_TMA = gluon_matmul.HAS_GLUON
except ImportError:
    HAS_TMA = False

# Int4 launches of TILING on this kernel where it runs (server/small_m_matmul.py); False: on
# server/gluon_matmul.py's. Off until a GPU run checks its bits and times it (the A/B:
# `python -m bench.step_ab --base-tree . --head-set server.gluon_ws_matmul.ON=True`).
ON = False
# Groups in flight (the ring's slots). Each slot: 4 KB of weight words, x's rows (4 KB a row tile),
# 256 bytes of scales and offsets.
STAGES = 4
# Registers a thread at launch, by row tiles 1-4 (see the module docstring), and the producer warp
# group's after setmaxnreg (the consumers get 2 x MAXNREG less it). x's copies take the producer's
# registers as the tiles grow, the accumulators the consumers' (ptxas on the CPU: with 40 for the
# producer, 3 and 4 tiles spilled 144 bytes; tests/test_gluon_ws_matmul_ptx.py checks none spill).
MAXNREG = (80, 80, 104, 104)
PRODUCER_REGS = (40, 40, 72, 72)


def registers(tiles: int) -> tuple[int, int]:
    """(the launch's registers a thread, the producer's) for `tiles` row tiles."""
    return MAXNREG[tiles - 1], PRODUCER_REGS[tiles - 1]


TILING = gluon_matmul.TILINGS[0]   # (64 columns a program, 4 warps): the consumers' layout
HALF = TILING[0] // 2              # columns a TMA box of weights, scales or offsets


def runs_on(device: torch.device) -> bool:
    """Whether `int4_step_matmul_ws` can run on `device`: Hopper's TMA and setmaxnreg (sm_90+)."""
    return HAS_TMA and gluon_matmul.runs_on(device) and torch.cuda.get_device_capability(device) >= (9, 0)


def descriptors(weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, pairs: bool) -> tuple:
    """TMA descriptors of an int4 linear's weight words ([K/8, N] int32: boxes of 16 words x HALF
    columns, half a group's tile) and its scales and offsets ([K/128, N] bf16: boxes of 2 x HALF, a
    group's 64 in one 128-byte box, since a TMA box's shared-memory destination must be 128-byte
    aligned). The scales are read as rows of HALF (the tile's two halves are consecutive rows) or,
    for GELU_PAIRS (`pairs`), as rows of N / 2 (a group's gate half, then its up half: rows 2 g and
    2 g + 1, at the tile's column). Built once a linear and epilogue: the tensors never move."""
    words = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    flat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    w = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [16, HALF], words)
    row = scale.shape[1] // 2 if pairs else HALF
    s, o = (TensorDescriptor.from_tensor(t.view(-1, row), [2, HALF], flat) for t in (scale, offset))
    return w, s, o


if HAS_TMA:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental import gluon
    from server.gluon_matmul import _copy_x, _epilogue, _group_products, _wait_prior

    @gluon.jit
    def _copy_weights_tma(w_desc, scale_desc, offset_desc, w_s, scale_s, offset_s, bar, slot, k0, live, N, pid_n,
                          EPILOGUE: gl.constexpr, BLOCK_N: gl.constexpr):
        """The group at feature k0: its weight words (the tile's two halves of HALF columns, at
        `_columns`' column starts), scales and offsets (one box each: `descriptors`) into ring slot
        `slot`, four TMA boxes counted on `bar` by their bytes. Nothing when `live` is false."""
        H: gl.constexpr = BLOCK_N // 2
        g = k0 // 128
        if EPILOGUE == 1:   # GELU_PAIRS: gate columns, then their up columns N / 2 on; scales in rows of N / 2
            c0 = pid_n * H
            c1 = N // 2 + pid_n * H
            at = [2 * g, c0]
        else:               # scales in rows of H: the tile's two halves are rows 2 pid_n, 2 pid_n + 1 of the group's
            c0 = pid_n * BLOCK_N
            c1 = c0 + H
            at = [g * (N // H) + 2 * pid_n, 0]
        nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes + 2 * scale_desc.block_type.nbytes
        mbarrier.expect(bar, nbytes, pred=live)
        w = w_s.index(slot)
        row = k0 // 8
        tma.async_copy_global_to_shared(w_desc, [row, c0], bar, w.slice(0, H, dim=1), pred=live)
        tma.async_copy_global_to_shared(w_desc, [row, c1], bar, w.slice(H, H, dim=1), pred=live)
        tma.async_copy_global_to_shared(scale_desc, at, bar, scale_s.index(slot), pred=live)
        tma.async_copy_global_to_shared(offset_desc, at, bar, offset_s.index(slot), pred=live)

    @gluon.jit
    def _producer(w_desc, scale_desc, offset_desc, x_ptr, w_s, x_s, scale_s, offset_s, full, empty, M, N,
                  stride_xm, k_begin, n_groups, pid_n, XROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, EPILOGUE: gl.constexpr, PDL: gl.constexpr, X_L1: gl.constexpr):
        """One warp: every group's operands into the ring, STAGES groups ahead of the consumers. Slot
        s's j-th fill waits for the consumers' (j-1)-th release of it (phase (j - 1) & 1 of its empty
        barrier); its full barrier completes when the four boxes' bytes and the 32 threads' x copies
        (each thread's cp.async arrive) are in."""
        if X_L1:  # 8-byte pieces through L1, as gluon_matmul's X_L1 (one warp: 16 copies a thread)
            XL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0])
        else:
            XL: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0])
        # the weights are read-only: the first slots' copies go before the wait for the kernel before this one
        for s in gl.static_range(STAGES):
            _copy_weights_tma(w_desc, scale_desc, offset_desc, w_s, scale_s, offset_s, full.index(s), s,
                              k_begin + s * 128, s < n_groups, N, pid_n, EPILOGUE, BLOCK_N)
        ready = _wait_prior(PDL)
        for i in range(n_groups):
            slot = i % STAGES
            if i >= STAGES:
                mbarrier.wait(empty.index(slot), ((i // STAGES) - 1) & 1)
                _copy_weights_tma(w_desc, scale_desc, offset_desc, w_s, scale_s, offset_s, full.index(slot), slot,
                                  k_begin + i * 128, True, N, pid_n, EPILOGUE, BLOCK_N)
            _copy_x(x_s, slot, x_ptr, k_begin + i * 128, ready != 0, M, stride_xm, XROWS, XL)
            cp.mbarrier_arrive(full.index(slot), increment_count=False)

    @gluon.jit
    def _consumer(x_ptr, w_s, x_s, scale_s, offset_s, full, empty, partial_ptr, count_ptr, out_ptr, M, N,
                  n_groups, pid_n, pid_k, u_ptr, stride_u, SPLIT: gl.constexpr, TILES: gl.constexpr,
                  ROWS: gl.constexpr, XROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  EPILOGUE: gl.constexpr, PDL: gl.constexpr, REDUCE: gl.constexpr):
        """The 4 warps of `int4_step_matmul` without its copies: per group, wait for the slot's
        operands, the products (gluon_matmul `_group_products`), release the slot; then its epilogue."""
        NW: gl.constexpr = gl.num_warps()
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=2)
        ready = _wait_prior(PDL)   # before any store: the kernel before may still read the scratch
        acc0 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        acc1 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        acc2 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        acc3 = gl.zeros([16, BLOCK_N], gl.float32, ACC)
        for i in range(n_groups):
            slot = i % STAGES
            mbarrier.wait(full.index(slot), (i // STAGES) & 1)
            packed = w_s.index(slot).load(B)
            scale = gl.expand_dims(scale_s.index(slot).reshape([BLOCK_N]).load(gl.SliceLayout(0, B)), 0)
            offset = gl.expand_dims(offset_s.index(slot).reshape([BLOCK_N]).load(gl.SliceLayout(0, B)), 0)
            acc0, acc1, acc2, acc3 = _group_products(x_s.index(slot), packed, scale, offset, acc0, acc1, acc2, acc3,
                                                     TILES, XROWS, BLOCK_N, ACC, A, x_ptr.dtype.element_ty)
            mbarrier.arrive(empty.index(slot))
        _epilogue(acc0, acc1, acc2, acc3, partial_ptr, count_ptr, out_ptr, M, N, pid_n, pid_k, u_ptr, stride_u, ready,
                  SPLIT, TILES, ROWS, BLOCK_N, EPILOGUE, REDUCE, ACC)

    @gluon.jit
    def int4_step_matmul_ws(x_ptr, w_desc, scale_desc, offset_desc, partial_ptr, count_ptr, out_ptr,
                            M, N, K, stride_xm, k_per_split, u_ptr, stride_u,
                            SPLIT: gl.constexpr, TILES: gl.constexpr, ROWS: gl.constexpr, XROWS: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            PDL: gl.constexpr = False, EPILOGUE: gl.constexpr = 0, REDUCE: gl.constexpr = True,
                            X_L1: gl.constexpr = False):
        """y[:M] = x @ W^T for one (column tile, K slice), as `int4_step_matmul`; see the module docstring."""
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        X_SHARED: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=4, max_phase=2, order=[1, 0])
        w_s = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BLOCK_N], w_desc.layout)
        x_s = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, 8 * XROWS, 16], X_SHARED)
        scale_s = gl.allocate_shared_memory(scale_desc.dtype, [STAGES, 2, BLOCK_N // 2], scale_desc.layout)
        offset_s = gl.allocate_shared_memory(offset_desc.dtype, [STAGES, 2, BLOCK_N // 2], offset_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=33)   # the boxes' expect, and each producer thread's x copies
            mbarrier.init(empty.index(s), count=1)   # the consumers' release (one arrive, after their sync)
        n_groups = k_per_split // 128
        k_begin = pid_k * k_per_split
        gl.warp_specialize([
            (_consumer, (x_ptr, w_s, x_s, scale_s, offset_s, full, empty, partial_ptr, count_ptr, out_ptr, M, N,
                         n_groups, pid_n, pid_k, u_ptr, stride_u, SPLIT, TILES, ROWS, XROWS, BLOCK_N, STAGES,
                         EPILOGUE, PDL, REDUCE)),
            (_producer, (w_desc, scale_desc, offset_desc, x_ptr, w_s, x_s, scale_s, offset_s, full, empty, M, N,
                         stride_xm, k_begin, n_groups, pid_n, XROWS, BLOCK_N, STAGES, EPILOGUE, PDL, X_L1)),
        ], [1], [PRODUCER_REGS])
