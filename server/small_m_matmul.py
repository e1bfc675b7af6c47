"""Batch-invariant matmuls for decode and verify steps (1..64 rows) on the GPU, in Triton.

Contract: `SmallMLinear.from_int4(packed, scale_shift, group_size, out_features)` (quanto's
tinygemm-packed int4 weight, read once and re-laid out), `SmallMLinear.from_dense(weight)`
(bf16 [N, K], shared, not copied) or `quantize_int8(weight)` (bf16 [N, K] quantized to int8, one
scale per group of 128 input features and output column: the LM head of a small card, see
server/fast_path.py) gives a callable `y = lin(x)`, x [..., K] bf16 with at most `MAX_ROWS` rows,
y [..., N] bf16. `lin(x, gelu_times=u)` (u [..., N], any row stride) gives gelu_tanh(y) * u, and
`lin.gelu_pairs()` (W = gate | up) a linear giving gelu_tanh(gate) * up [..., N / 2]: the activation
in the matmul's epilogue, one launch, the bits of the separate kernel (server/fast_path.py `_gelu_mul`);
`lin.softcapped(cap)` one storing tanh(y / cap) * cap (the LM head's soft-capped logits).

Why not tinygemm (quanto's kernel): its int4 matmul time grows with the number of rows (E4B:
2.4 ms a step for 1 row, 5.8 ms for 16), so a 16-token verify cost 1.8x a decode step; and cuBLAS /
tinygemm pick different kernels (different summation orders) for different row counts, so a
token's logits in a 16-token verify differ in the last bits from the same token's logits in a
1-token step, and near-tied argmaxes flip.

Here one kernel serves every row count: rows are padded to tiles of TILE_M = 16 rows (1 to 4
tiles), the K axis is cut into the same fixed chunks whatever the rows, and the chunks' partial
sums are added in a fixed order. Each row tile has its own accumulator and its own product of the
one shape a single tile uses, against the same decoded weight tile (read once for all row tiles):
the tile size never grows with the rows, because a larger tensor-core tile (wgmma on Hopper) is a
different instruction whose rounding need not match. Invariant: row i of the output is
bit-identical whatever the other rows hold and however many there are (a tensor-core product's
row i reads only row i of its left operand, and the instructions and their order do not depend on
the row count). That makes a
verify step's logits equal the one-token steps', so drafted decoding is exactly plain decoding on
this path, near-ties included.

Int4 weights run on server/gluon_matmul.py's kernel where it runs (CUDA sm_80+, Gluon): the same
products and bits as `_small_m_kernel` below, its operands copied into shared memory in fewer,
wider pieces and its codes unpacked two at a time by a byte permute and a LOP3 (on the H200 a
one-row forward's int4 matmuls take 20% less time, 1.89 against 2.36 ms, and 15% less at 64
rows); int8 and dense weights, the interpreter and other GPUs use `_small_m_kernel`.

Int4 layout: `qweight` int32 [K/8, N]; within each group of 128 input features (16 words per
column), nibble j of word r holds the 4-bit code of feature 16 j + r, so the kernel loads a group as
one [16, BLOCK_N] tile and takes eight contiguous 16-feature slices from it by shifting;
`scale`, `offset` bf16 [K/group, N] with W = code * scale + offset (tinygemm's
(code - 8) * scale + shift, the -8 folded into offset). Codes become bf16 without an int-to-float
conversion: the bits 0x4300 | code are the bf16 number 128 + code. Weights are streamed once per step. The
floor is their bytes at the memory's rate; on the H200 the largest linear (E4B's gate|up) runs at
about 1.6 TB/s on the Gluon kernel (1.2 on this one), well short of it (bench/small_m_bench.py
--cold). On this kernel decoding half the work per weight (scales applied per group after the
products) and one layout change per group instead of eight were both slower (e458c5f), and with
the decoding cut to a shift and an OR, or with no products at all, gate|up took as long: its loads
bound it. The Gluon kernel moves its operands better, and there the decoding's integer
instructions were a bound of their own (server/gluon_matmul.py).

Prefill reads the same layout: `dequantize_t` writes one linear's W^T into a scratch buffer shared
by all linears (`share_prefill_scratch`, the size of the largest) for one cuBLAS GEMM over many
rows, so no second int4 copy (quanto's) is kept beside this one.

Int8 layout: `weight` int8 [K, N] (codes -127..127, contiguous along N as the int4 words are),
`scale` bf16 [K/128, N]: W = code * scale, computed in fp32 and rounded once to bf16.

Launch: on Hopper and later every step kernel (these, step attention, the stacked steps' writes)
and the compiled elementwise ops use programmatic dependent launch (`pdl_launch`): a kernel is
scheduled while the one before it ends and waits for it before touching memory another kernel
writes (server/gpu_kernels.py `_pdl_start`; the Gluon int4 kernel copies its first weights before
it: server/gluon_matmul.py PREFETCH; tests/test_pdl_ptx.py), which hides part of the gap between
two of a step's ~700 launches. Measured on the H200 (E4B shape, in one process, the step kernels'
PDL off and on, the compiled ops' on in both): a 1-token step 4.96 -> 4.59 ms, 4 lanes' 4-token
steps 6.09 -> 5.29 ms. Same bits either way.

Split-K: each (N tile, K slice) program writes its fp32 partial; the last program of an N tile to
arrive (an atomic counter per tile) sums the slices in slice order and writes the output, then
resets its counter, so one launch does the whole product and the order of the sum never depends on
which program finished first. Or (`slices`) the partials are the launch's output and the kernel
that reads y adds them, in the same order (`sum_slices`): the step's norms do, so the matmul has no
counter, fence or serial tail. The partials' scratch (split x 64 rows x N fp32) may be shared by
linears that run one after another on one stream (`share_partials`): a launch reads only what it
wrote, and the next one starts after it ends.
"""
from __future__ import annotations

import torch

MAX_ROWS = 64       # rows one call takes: up to 4 tiles of TILE_M
TILE_M = 16         # rows per tensor-core tile, whatever the row count (see the module docstring)
BLOCK_K = 128       # also the int4 group size this kernel supports (quanto's default)
# ~2 programs per SM on an H100/H200 and a 3-stage pipeline: fastest per forward on cold weights of
# the E4B shapes (bench/small_m_bench.py --cold; more K slices add partials to write and sum).
TARGET_PROGRAMS = 264   # read as each linear is built (a run may set it first: bench.step_ab --base-set)
NUM_STAGES = 3


def triton_available() -> bool:
    """Whether Triton imports here: the GPU kernels (server/gpu_kernels.py: these step matmuls, the
    step attention, prefill's softmax) need it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# What a launch stores (server/gpu_kernels.py `_small_m_kernel`'s EPILOGUE): y = x @ W^T itself, or the
# activation that reads it, fused so that the step skips a launch: gelu(gate) * up from W = gate | up
# (`gelu_pairs`), gelu(y) * u for a given u (`lin(x, gelu_times=u)`).
PLAIN, GELU_PAIRS, GELU_TIMES = 0, 1, 2
# ... or tanh(y / cap) * cap (`softcapped`): Gemma's soft-capped logits in the LM head's store
SOFTCAP = 3

PDL = True          # programmatic dependent launch where the GPU has it (pdl_launch)
GLUON = True        # int4 weights on server/gluon_matmul.py's kernel where it runs (False: A/B runs)
# From this many rows on, an int4 launch on the Gluon kernel runs WIDE_TILING (columns a program,
# warps), one of server/gluon_matmul.py's TILINGS: 128 columns a program on 4 warps, each warp 32
# columns, so each x slice a warp reads from shared memory feeds four products instead of two, and
# half as many programs copy x. Same K slices, so the same bits (a column's sums do not depend on its
# tile or warp: tests/test_step_kernel_rows.py). Measured on an H100, one sitting (E4B shape, int4):
# per shape on cold weights (`python -m bench.small_m_bench --cold`, bench/results/small_m_cold-tilings-h100.md)
# gate|up at 16 / 32 / 64 rows 23.9 / 32.1 / 64.8 -> 20.2 / 27.3 / 43.3 us, the small linears slower at
# 64 rows (ple gate 10.6 -> 25.3); whole steps at 1k context (a throwaway script, one process each, the
# form `python -m bench.step_ab --rows 32 48 64` now takes): 32 rows 5.04 -> 4.78 ms, 48 and 64 rows
# level (7.86 / 7.91 -> 8.00 / 7.99), the 64-token steps' logits the same bits. 32 rows is the forward
# of 3-16 lanes' drafts (server/fast_batch.py `shared_rows`). One row tile keeps the linear's own
# tiling: a one-row gate|up took 16.5 us on it and 20.3 on this one. None: the own tiling always.
# The rule counts rows, not row tiles, so that one row tile could go wide by its rows (the bits are the
# same either way: same K slices). It does not pay there: from 8 rows on (an H100, one round of
# `python -m bench.step_ab --base-tree . --base-set server.small_m_matmul.WIDE_FROM_ROWS=17 --head-set
# ...=8 --rows 8`, bench/results/step_ab-wide-rows8-h100.md) a 16-token verify took 4.25 ms against
# 4.06 and an 8-token step 3.94 against 3.64, its matmuls 2.48 against 2.27 ms, where the cold
# per-shape table promised gate|up 23.9 -> 20.2 us at 16 rows. So one row tile keeps the own tiling.
WIDE_FROM_ROWS: int | None = 17
WIDE_TILING = (128, 4)
# Only linears of at least this many output columns switch (0: every one the tiling fits): gate|up and
# the per-layer model projection on E4B. At 64 rows the small linears lose on the wide tiling what gate|up
# gains (the per-shape table), and on whole forwards (an H100, two sittings of
# `python -m bench.gpu_concurrency --streams 1,4,16 --turn 64 --rows auto`, docs/bars.md 12-06):
# 4 streams 2.66x / 2.68x one stream's tokens/s with it against 2.48-2.58x with every linear wide
# (their forwards 5.28-5.37 against 5.41-5.60 ms, p50 1.45-1.47x solo against 1.51-1.57x), a 64-row
# step 7.55 against 8.02 ms; 16 streams too noisy to call (2.86x and 1.84x against 2.48-2.54x).
WIDE_MIN_COLUMNS = 8192


def pdl_launch(device: torch.device) -> dict:
    """The launch arguments of a step kernel on `device`: with programmatic dependent launch
    (Hopper and later; server/gpu_kernels.py `_pdl_start`) {"PDL": True, "launch_pdl": True}, else {}
    (older GPUs, Triton's interpreter). Every kernel launched so waits for the one before it."""
    import os

    if not PDL or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    from server.gpu_kernels import HAS_PDL
    if not HAS_PDL or torch.cuda.get_device_capability(device)[0] < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


def _block_n(n: int) -> int:
    """Output columns per program (0: N does not tile)."""
    return 64 if n % 64 == 0 else 32 if n % 32 == 0 else 0


def unsupported_shape(lin) -> str | None:
    """None when `as_small_m(lin)` works, else why not."""
    if isinstance(lin, SmallMLinear) or hasattr(lin, "step_layout"):   # server/fast_path.py's ReleasedLinear: already this layout
        return None
    if getattr(lin, "packed", None) is not None:
        k, n, group = lin.scale_shift.shape[0] * lin.group_size, lin.out_features, lin.group_size
        if group != BLOCK_K:
            return f"int4 group size {group} (step kernels take {BLOCK_K})"
    else:
        n, k = lin.weight.shape
        if lin.weight.dtype != torch.bfloat16:
            return f"{lin.weight.dtype} weights (step kernels take bf16 or int4)"
    if k % BLOCK_K or not _block_n(n):
        return f"a {n}x{k} weight does not tile by (32, {BLOCK_K})"
    return None


def as_small_m(lin) -> "SmallMLinear":
    """The step kernel of one of server/fast_path.py's linears (Int4Linear, DenseLinear, ReleasedLinear),
    or the SmallMLinear itself."""
    if isinstance(lin, SmallMLinear):
        return lin
    if hasattr(lin, "step_layout"):
        return lin.step_layout()
    if getattr(lin, "packed", None) is not None:
        k = lin.scale_shift.shape[0] * lin.group_size
        return SmallMLinear.from_int4(lin.packed, lin.scale_shift, lin.group_size, lin.out_features, k)
    return SmallMLinear.from_dense(lin.weight)


def concat(parts: list) -> "SmallMLinear | None":
    """One SmallMLinear computing the parts' outputs side by side (one launch instead of several),
    or None when they differ in kind or input size. Copies the weights."""
    if len({p.int4 for p in parts}) != 1 or len({p.k for p in parts}) != 1 or any(p.int8 for p in parts):
        return None
    n = sum(p.n for p in parts)
    if parts[0].int4:
        cat = lambda name: torch.cat([getattr(p, name) for p in parts], 1).contiguous()
        return SmallMLinear(cat("weight"), cat("scale"), cat("offset"), n, parts[0].k)
    return SmallMLinear(torch.cat([p.weight for p in parts], 0), None, None, n, parts[0].k)


def _plan(n: int, k: int, block_n: int, target_programs: int) -> int:
    """Number of K slices: enough programs to fill the GPU, each slice a whole number of blocks."""
    tiles = -(-n // block_n)
    blocks = k // BLOCK_K
    split = 1
    for candidate in range(1, blocks + 1):
        if blocks % candidate == 0:
            split = candidate
            if tiles * candidate >= target_programs:
                break
    return split


class SmallMLinear:
    """y = x @ W^T for 1..MAX_ROWS rows, batch-invariant (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None,
                 n: int, k: int, block_n: int | None = None, num_warps: int = 4, num_stages: int = NUM_STAGES,
                 target_programs: int | None = None, magic: bool = True, split: int | None = None,
                 gluon_stages: int | None = None):
        block_n = block_n or _block_n(n)
        if k % BLOCK_K or not block_n or n % block_n:
            raise ValueError(f"shape N={n}, K={k} does not tile by ({block_n}, {BLOCK_K})")
        self.weight, self.scale, self.offset = weight, scale, offset
        self.n, self.k, self.block_n, self.num_warps = n, k, block_n, num_warps
        self.int8 = weight.dtype == torch.int8
        self.int4 = scale is not None and not self.int8
        self.magic = magic and self.int4 and scale.dtype == torch.bfloat16
        self.num_stages = num_stages
        # K slices: planned for the GPU's programs, or given (a bench's other column tiles with the same
        # K slices, hence the same sums and bits)
        self.split = split or _plan(n, k, block_n, target_programs or TARGET_PROGRAMS)
        if (k // BLOCK_K) % self.split:
            raise ValueError(f"{self.split} K slices do not divide {k // BLOCK_K} groups")
        # The split-K scratch: one buffer shared by a model's linears (`share_partials`), else this
        # linear's own, made at its first call. Not made here: a model's linears, each with its own
        # until they are shared, would hold ~1.2 GiB at once on E4B while the fast path is built.
        self.partial: torch.Tensor | None = None
        self.count = torch.zeros(-(-n // block_n), dtype=torch.int32, device=weight.device)
        self._launch = pdl_launch(weight.device)
        # int4 weights run on server/gluon_matmul.py's kernel where it runs (same bits, faster)
        from server import gluon_matmul, gluon_ws_matmul
        self.gluon = (GLUON and self.magic and (block_n, num_warps) in gluon_matmul.TILINGS
                      and gluon_matmul.runs_on(weight.device))
        self.gluon_stages = gluon_stages or gluon_matmul.STAGES
        # server/gluon_ws_matmul.py's kernel runs here (its tiling's launches take it while its ON is set),
        # and its TMA descriptors of weight, scale and offset, made at its first launch
        self.ws = self.gluon and gluon_ws_matmul.runs_on(weight.device)
        self._tma = None
        self.epilogue = PLAIN
        self.cap = 0.0      # SOFTCAP's
        # False: a call's split-K slices store their partials and end, the output unwritten (what
        # bench.small_m_bench --chain-tails times); never set when serving (`slices` is the way)
        self.reduce = True

    @property
    def out_features(self) -> int:
        return self.n // 2 if self.epilogue == GELU_PAIRS else self.n

    def gelu_pairs(self) -> "SmallMLinear":
        """This linear, W = gate | up (equal halves), as one computing gelu_tanh(gate) * up (N / 2
        columns): the MLP's activation in the matmul's epilogue, one launch where there were two.
        Same tensors (no copy) and K slices, so gate and up are the bits this linear computes; the
        activation is server/fast_path.py `_gelu_mul`'s arithmetic on them (tests/test_step_kernel_rows.py)."""
        return self._with_epilogue(GELU_PAIRS, "gelu_pairs")

    def softcapped(self, cap: float) -> "SmallMLinear":
        """This linear as one storing tanh(y / cap) * cap: Gemma's final logit soft-capping in the LM
        head's epilogue, one launch (and one pass over the logits) less a step. The same tensors
        and K slices; y is rounded to the output's dtype first, as the separate op (server/fast_ops.py
        `_softcap`) reads the stored logits, and tanh is libdevice's, as torch.compile's kernel calls
        it: the same formula, not necessarily the compiled op's last bit (inductor may multiply by
        1 / cap). Every step runs it, so steps stay batch-invariant. On `_small_m_kernel` (a bf16 or
        int8 head; the Gluon kernel has no such epilogue)."""
        capped = self._with_epilogue(SOFTCAP, "softcapped")
        capped.cap, capped.gluon = float(cap), False
        return capped

    def _with_epilogue(self, epilogue: int, what: str) -> "SmallMLinear":
        """This linear's twin storing `epilogue`: the same tensors (no copy), tiling, K slices and
        split-K scratch, so its products are the bits this linear computes."""
        if self.epilogue != PLAIN:
            raise ValueError(f"{what} of a linear that already has an epilogue")
        twin = SmallMLinear(self.weight, self.scale, self.offset, self.n, self.k, block_n=self.block_n,
                            num_warps=self.num_warps, num_stages=self.num_stages, magic=self.magic, split=self.split,
                            gluon_stages=self.gluon_stages)
        twin.epilogue, twin.partial = epilogue, self.partial
        return twin

    @classmethod
    def from_int4(cls, packed: torch.Tensor, scale_shift: torch.Tensor, group_size: int, out_features: int,
                  in_features: int, **kw) -> "SmallMLinear":
        """From quanto's tinygemm int4 (packed codes, scale_shift [K/group, N, 2]); W = (code - 8) * scale + shift."""
        if group_size != BLOCK_K:
            raise ValueError(f"int4 group size {group_size} (this kernel supports {BLOCK_K})")
        codes = unpack_tinygemm(packed, out_features, in_features)
        scale = scale_shift[:, :, 0].contiguous()                                   # [K/group, N]
        offset = (scale_shift[:, :, 1].float() - 8 * scale.float()).to(scale.dtype).contiguous()
        return cls(pack_codes(codes), scale, offset, out_features, in_features, **kw)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, **kw) -> "SmallMLinear":
        n, k = weight.shape
        return cls(weight.contiguous(), None, None, n, k, **kw)

    def __call__(self, x: torch.Tensor, gelu_times: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T; with `gelu_times` (the output's shape, any row stride) gelu_tanh(x @ W^T) * gelu_times,
        in one launch; a `gelu_pairs` linear gives gelu_tanh(gate) * up."""
        return self._launch_kernel(x, gelu_times, self.reduce)

    def slices(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T left unsummed: its K slices' fp32 partials [split, M, N] (M = x's rows), which
        added in slice order (from the first, `sum_slices`) and rounded once to x's dtype are
        `self(x)` (equal values; a zero's sign may differ, as the launch's own sum starts from +0).
        With one K slice, y itself as [1, M, N] in x's dtype. The kernel that reads y sums them
        (server/fast_path.py's step ops), so this launch skips its sum: no counter, no fence and
        no tail where the last slice's program adds every slice (bench.small_m_bench --chain-tails:
        0.39 ms of a one-row step's E4B matmuls, 1.27 ms of a 16-row verify's).

        The partials live in the split-K scratch, shared (`share_partials`): read them before the
        next linear runs. A linear with an epilogue has none (its activation reads the sum)."""
        if self.epilogue != PLAIN:
            raise ValueError("slices of a linear with an epilogue: its activation needs the sum")
        m = x.reshape(-1, self.k).shape[0]
        if self.split == 1:
            return self._launch_kernel(x, None, True).reshape(1, m, self.n)
        self._launch_kernel(x, None, False)
        return self.partial[:self.split * m * self.n].view(self.split, m, self.n)

    def _launch_kernel(self, x: torch.Tensor, gelu_times: torch.Tensor | None, reduce: bool) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        m = x2.shape[0]
        if m > MAX_ROWS:
            raise ValueError(f"{m} rows exceed this kernel's {MAX_ROWS}")
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty((m, self.out_features), dtype=x.dtype, device=x.device)
        epilogue, times = self.epilogue, out
        if gelu_times is not None:
            if epilogue != PLAIN or gelu_times.shape != (*lead, self.n):
                raise ValueError(f"gelu_times of shape {tuple(gelu_times.shape)} for an output of {(*lead, self.n)}")
            epilogue, times = GELU_TIMES, gelu_times.reshape(m, self.n)
            if times.stride(-1) != 1:
                times = times.contiguous()
        if self.partial is None:
            self.partial = torch.empty((max(1, self.partial_numel()),), dtype=torch.float32, device=self.weight.device)
        tiles = max(1, -(-m // TILE_M))
        if self.gluon:
            from server import gluon_matmul, gluon_ws_matmul
            from server.gluon_matmul import int4_step_matmul, x_rows
            block_n, warps = self._gluon_tiling(m)
            if gluon_ws_matmul.ON and self.ws and (block_n, warps) == gluon_ws_matmul.TILING:
                self._launch_ws(x2, out, m, tiles, epilogue, times, reduce)
                return out.reshape(*lead, self.out_features)
            int4_step_matmul[(self.n // block_n, self.split)](
                x2, self.weight, self.scale, self.offset, self.partial, self.count, out, m, self.n, self.k,
                x2.stride(0), self.k // self.split, times, times.stride(0), SPLIT=self.split, TILES=tiles,
                ROWS=tiles * TILE_M, XROWS=x_rows(tiles), BLOCK_N=block_n, STAGES=self.gluon_stages,
                EPILOGUE=epilogue, PREFETCH=bool(gluon_matmul.PREFETCH and self._launch), REDUCE=reduce,
                X_L1=m <= gluon_matmul.X_VIA_L1_ROWS, PAIRED=gluon_matmul.RING_PAIR and self.gluon_stages == 2,
                num_warps=warps, **self._launch)
            return out.reshape(*lead, self.out_features)
        from server.gpu_kernels import _small_m_kernel
        _small_m_kernel[(self.n // self.block_n, self.split)](
            x2, self.weight, self.scale if self.scale is not None else self.weight,
            self.offset if self.int4 else self.weight,
            self.partial, self.count, out, m, self.n, self.k, x2.stride(0), self.k // self.split, times,
            times.stride(0), INT4=self.int4, INT8=self.int8, SPLIT=self.split, MAGIC=self.magic, TILES=tiles,
            ROWS=tiles * TILE_M, BLOCK_M=TILE_M, BLOCK_N=self.block_n, BLOCK_K=BLOCK_K, EPILOGUE=epilogue,
            REDUCE=reduce, CAP=self.cap, num_warps=self.num_warps, num_stages=self.num_stages, **self._launch)
        return out.reshape(*lead, self.out_features)

    def _launch_ws(self, x2: torch.Tensor, out: torch.Tensor, m: int, tiles: int, epilogue: int,
                   times: torch.Tensor, reduce: bool) -> None:
        """This int4 linear's launch on server/gluon_ws_matmul.py's kernel (its tiling, the same bits):
        the weights, scales and offsets through TMA descriptors, made at the first launch."""
        from server import gluon_matmul, gluon_ws_matmul
        if self._tma is None:  # a linear's epilogue is fixed (a twin per epilogue; GELU_TIMES reads plain tiles)
            pairs = self.epilogue == GELU_PAIRS
            self._tma = gluon_ws_matmul.descriptors(self.weight, self.scale, self.offset, pairs)
        block_n, warps = gluon_ws_matmul.TILING
        maxnreg, producer_regs = gluon_ws_matmul.registers(tiles)
        gluon_ws_matmul.int4_step_matmul_ws[(self.n // block_n, self.split)](
            x2, *self._tma, self.partial, self.count, out, m, self.n, self.k, x2.stride(0), self.k // self.split,
            times, times.stride(0), SPLIT=self.split, TILES=tiles, ROWS=tiles * TILE_M,
            XROWS=gluon_matmul.x_rows(tiles), BLOCK_N=block_n, STAGES=gluon_ws_matmul.STAGES,
            PRODUCER_REGS=producer_regs, EPILOGUE=epilogue, REDUCE=reduce,
            X_L1=m <= gluon_matmul.X_VIA_L1_ROWS, num_warps=warps, maxnreg=maxnreg, **self._launch)

    def _gluon_tiling(self, rows: int) -> tuple[int, int]:
        """(columns a program, warps) of a Gluon launch of `rows` rows: WIDE_TILING from
        WIDE_FROM_ROWS rows on, on a linear of WIDE_MIN_COLUMNS columns or more that it tiles (its
        programs' counters fit: this linear's tiles are at most as wide), else the linear's own."""
        if WIDE_FROM_ROWS is not None and rows >= WIDE_FROM_ROWS and self.n >= WIDE_MIN_COLUMNS:
            block_n, warps = WIDE_TILING
            if self.n % block_n == 0 and block_n >= self.block_n:
                return block_n, warps
        return self.block_n, self.num_warps

    def partial_numel(self) -> int:
        """fp32 scratch this linear needs for MAX_ROWS rows (0 without split-K)."""
        return self.split * MAX_ROWS * self.n if self.split > 1 else 0

    def dequantize(self) -> torch.Tensor:
        """W [N, K] as the kernel sees it (bf16): for tests and reference products."""
        if self.int8:
            scale = self.scale.float().repeat_interleave(BLOCK_K, 0)
            return (self.weight.float() * scale).to(self.scale.dtype).t()
        if not self.int4:
            return self.weight
        codes = unpack_codes(self.weight).to(torch.float32)
        scale = self.scale.float().repeat_interleave(BLOCK_K, 0).t()
        offset = self.offset.float().repeat_interleave(BLOCK_K, 0).t()
        return (codes * scale + offset).to(self.scale.dtype)

    def dequantize_t(self, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """W^T [K, N] (row-major, the scale's dtype) of an int4 linear, for prefill GEMMs (x @ W^T with
        many rows): written into the first K*N elements of `scratch` (a flat buffer shared by linears
        that run one after another on one stream, see `share_prefill_scratch`), or a new tensor. On
        CUDA one Triton launch (bit for bit `dequantize().t()`); elsewhere `dequantize().t()` itself."""
        k, n = self.k, self.n
        out = (torch.empty(k * n, dtype=self.scale.dtype, device=self.weight.device) if scratch is None
               else scratch[:k * n]).view(k, n)
        if self.weight.device.type != "cuda":
            return out.copy_(self.dequantize().t())
        from server.gpu_kernels import _dequant_kernel
        _dequant_kernel[(k // BLOCK_K, n // self.block_n)](self.weight, self.scale, self.offset, out, n,
                                                           BLOCK_N=self.block_n, num_warps=4)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.offset) if t is not None)


def quantize_int8(weight: torch.Tensor, rows_per_chunk: int = 16384) -> SmallMLinear:
    """W [N, K] (bf16) as an int8 SmallMLinear: per group of BLOCK_K input features and output
    column, scale = max |w| / 127 (rounded to the weight's dtype first, so that code * scale is
    what the kernel computes), code = round(w / scale). Computed on W's device in chunks of rows, so
    the fp32 temporaries stay small (E4B's 262,144 x 2,560 head: 160 MiB at a time)."""
    n, k = weight.shape
    if k % BLOCK_K or not _block_n(n):
        raise ValueError(f"a {n}x{k} weight does not tile by (32, {BLOCK_K})")
    codes = torch.empty((k, n), dtype=torch.int8, device=weight.device)
    scale = torch.empty((k // BLOCK_K, n), dtype=weight.dtype, device=weight.device)
    for lo in range(0, n, rows_per_chunk):
        w = weight[lo:lo + rows_per_chunk].float().view(-1, k // BLOCK_K, BLOCK_K)
        s = (w.abs().amax(-1, keepdim=True) / 127).to(weight.dtype).float()
        q = torch.where(s > 0, w / s.clamp_min(torch.finfo(torch.float32).tiny), 0).round_().clamp_(-127, 127)
        codes[:, lo:lo + w.shape[0]] = q.view(-1, k).to(torch.int8).t()
        scale[:, lo:lo + w.shape[0]] = s[..., 0].to(weight.dtype).t()
    return SmallMLinear(codes, scale, None, n, k)


def sum_slices(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A linear's output from `SmallMLinear.slices` [S, ..., N]: slice 0 plus slice 1 plus ... in
    fp32, in slice order, rounded once to `dtype`: the sum the launch itself would have made. Per
    element, and each linear's S is fixed by its shape, so a row's sum never depends on the others.
    The step ops of server/fast_path.py call it inside their compiled kernels."""
    y = p[0]
    for s in range(1, p.shape[0]):
        y = y + p[s]
    if dtype == torch.bfloat16 and y.dtype == torch.float32:
        y = round_to_bfloat16(y)
    return y.to(dtype)


def round_to_bfloat16(y: torch.Tensor) -> torch.Tensor:
    """fp32 y rounded to the nearest bfloat16 (ties to even), still fp32: what y.to(torch.bfloat16)
    gives, in integer arithmetic. Why: torch.compile elides a downcast that an upcast in the same
    kernel undoes (inductor's emulate_precision_casts, off by default), so inside a compiled op
    y.to(bfloat16).float() would be y; this rounding it keeps (NaN stays NaN; overflow gives inf)."""
    bits = y.view(torch.int32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
    return torch.where(y != y, y, rounded)


def share_prefill_scratch(linears: list) -> int:
    """Give every int4 linear one shared bf16 buffer (`prefill_scratch`) the size of the largest
    W^T, for `dequantize_t` in prefill; returns its bytes. Same rule as `share_partials`: only for
    linears used one after another on one stream (a GEMM reads the buffer before the next linear's
    dequantization overwrites it, because both are queued on that stream in that order)."""
    lins = [lin for lin in linears if lin.int4]
    if not lins:
        return 0
    shared = torch.empty(max(lin.n * lin.k for lin in lins), dtype=lins[0].scale.dtype, device=lins[0].weight.device)
    for lin in lins:
        lin.prefill_scratch = shared
    return shared.numel() * shared.element_size()


def share_partials(linears: list) -> int:
    """Point every linear's split-K scratch at one buffer, the size of the largest need; returns its
    bytes. Only for linears that run one at a time on one stream (one model's step forward): each
    launch writes its partials before reading them back, and the next launch starts after it ends.
    Call before any CUDA graph captures the linears (a graph keeps the pointers it saw)."""
    need = max((lin.partial_numel() for lin in linears), default=0)
    if not linears or not need:
        return 0
    shared = torch.empty(need, dtype=torch.float32, device=linears[0].weight.device)
    for lin in linears:
        lin.partial = shared
    return need * 4


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (0..15) -> qweight int32 [K/8, N] in this module's layout: group b of 128
    features, word r of the group, nibble j holds feature 128 b + 16 j + r."""
    n, k = codes.shape
    shifts = torch.arange(8, device=codes.device, dtype=torch.int32) * 4
    blocks = codes.to(torch.int32).t().reshape(k // BLOCK_K, 8, 16, n)            # [group, j, r, N]
    return (blocks << shifts[None, :, None, None]).sum(1, dtype=torch.int32).reshape(k // 8, n).contiguous()


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_codes: qweight int32 [K/8, N] -> codes [N, K] (int32)."""
    k8, n = qweight.shape
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int32) * 4
    words = qweight.reshape(k8 // 16, 1, 16, n)                                    # [group, 1, r, N]
    return ((words >> shifts[None, :, None, None]) & 0xF).reshape(k8 * 8, n).t().contiguous()


def unpack_tinygemm(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The 4-bit codes [N, K] (int32, 0..15) of a tinygemm-packed weight, read back through
    tinygemm itself (as quanto's own unpack does): an identity input with scale 1 and shift 8
    returns each code exactly. Done in column chunks to bound the identity matrix's memory."""
    group = 32
    ones = torch.ones((in_features // group, out_features, 2), dtype=torch.bfloat16, device=packed.device)
    ones[:, :, 1] = 8
    codes = torch.empty((out_features, in_features), dtype=torch.int32, device=packed.device)
    step = 2048
    for start in range(0, in_features, step):
        stop = min(in_features, start + step)
        eye = torch.zeros((stop - start, in_features), dtype=torch.bfloat16, device=packed.device)
        eye[:, start:stop] = torch.eye(stop - start, dtype=torch.bfloat16, device=packed.device)
        codes[:, start:stop] = torch._weight_int4pack_mm(eye, packed, group, ones).t().to(torch.int32)
    return codes
