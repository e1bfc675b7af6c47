"""How much GPU memory the fast path (server/fast_path.py) takes, and the plan that fits it to a card.

Contract: `fast_memory_needs(model, buckets, prefill_rows, lanes)` gives (bytes per context position,
fixed bytes) that a FastTarget adds to the loaded weights, from the model's shape alone;
`plan_fast_memory(model, max_context, cap, prefix_bytes, gpu_memory, buckets, lanes, lm_head)` sizes
the static cache's context, prefill's pieces, the dense prefill copy, the LM head (bf16 or int8) and
the prefix cache's budget from free memory or a cap (`--gpu-memory-mb`, which counts what nvidia-smi
shows: the CUDA context and libraries, measured when planning, and CAP_SLACK included). The engine
plans, then builds the FastTarget the plan describes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from server.fast_path import DEFAULT_BUCKETS, DEFAULT_PREFILL_ROWS, SMALL_PREFILL_ROWS, model_device
from server.small_m_matmul import BLOCK_K, MAX_ROWS, triton_available, unsupported_shape


@dataclass
class FastMemoryPlan:
    context: int        # positions the static cache serves
    prefix_bytes: int   # budget of the prefix cache's snapshots
    note: str
    prefill_rows: int = DEFAULT_PREFILL_ROWS   # FastTarget.prefill_rows
    prefill_dense: bool = False                # keep a dense bf16 copy of the int4 weights for prefill
    reserve: int = 0                           # bytes set aside for what does not grow with the context
    per_pos: int = 0                           # bytes per context position (KV, step attention scratch, RoPE)
    lanes: int = 1                             # FastTargets planned for (reserve and per_pos count them all)
    lm_head_int8: bool = False                 # FastTarget(lm_head_int8=...): the head in int8, the table on the host
    cap: int | None = None                     # --gpu-memory-mb in bytes (None: no cap)
    outside: int = 0                           # the CUDA context and libraries when planned (see settle_after_warmup)


GIB = 2**30


# Under a cap, room kept for what the plan cannot count: the allocator's reserve above its peak
# allocation (bench.gpu_memory, E4B shape at 32k with expandable segments: 0.23 GiB with the bf16
# head, 0.28 with the int8 one). What the CUDA context grows by after planning is settled after
# warm-up (settle_after_warmup).
CAP_SLACK = 256 * 2**20

# What a fresh process's CUDA context grows by when the fast path's kernels load (its warm-up: Triton
# step kernels, graphs, a prefill's cuBLAS kernels): 0.19 and 0.21 GiB at 8k and 32k in
# bench.gpu_engine_memory's fresh processes on the H200 (0.61 GiB when planned, 0.80 and 0.82 after
# warm-up). A plan made before any fast path has warmed up in this process counts it as taken;
# settle_after_warmup measures what it really was.
FRESH_CONTEXT_GROWTH = 224 * 2**20
_warmed_up = False  # a fast path has warmed up in this process: its kernels are in the context


def outside_memory(device) -> int:
    """The CUDA context and libraries: what the card shows used less what PyTorch holds in this
    process (so other processes on the card count too; nvidia-smi's per-process figure needs NVML)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def int8_head_saving(model) -> int:
    """GPU bytes FastTarget(lm_head_int8=True) frees: the bf16 head and the input table leave the
    GPU (one tensor when tied, as in Gemma), the int8 codes and their scales come (0 when an
    earlier fast path already did it)."""
    head = model.lm_head
    if hasattr(head, "_sailfish_int8"):
        return 0
    w, table = head.weight, model.model.embed_tokens.weight
    on_gpu = lambda t: t.device.type != "cpu"   # (meta tensors: the planner's tests)
    gone = w.numel() * w.element_size() if on_gpu(w) else 0
    if on_gpu(table) and table is not w:
        gone += table.numel() * table.element_size()
    n, k = w.shape
    return gone - (n * k + (k // BLOCK_K) * n * w.element_size())


def int8_head_unfit(model) -> str | None:
    """None when the int8 head saves GPU memory here, else why not: it needs the step kernels
    (Triton, bf16 weights; without them the head is dequantized back to a bf16 copy) and a head
    whose shape tiles for them."""
    if (why := unsupported_shape(model.lm_head)) is not None:
        return f"the int8 head runs on the step kernels, which do not take the LM head: {why}"
    if not triton_available():
        return "the int8 head runs on the step kernels, which need Triton"
    return None


def _int4_weights(model) -> int:
    """Weights the fast path holds as int4 (quanto tinygemm, or already in the step layout)."""
    n = 0
    for module in model.modules():
        released = getattr(module, "_sailfish_released", None)
        if released is not None:
            n += (released[2] - released[1]) * released[0][4]
            continue
        weight = getattr(module, "weight", None)
        if type(weight).__name__ == "TinyGemmWeightQBitsTensor":
            n += weight.shape[0] * weight.shape[1]
    return n


def _split_k_bytes(layers, hidden: int, ple_dim: int, vocab: int) -> int:
    """fp32 bytes of the largest split-K scratch a step linear needs, as planned now
    (server/small_m_matmul.py `_plan` at TARGET_PROGRAMS), over the linears that
    share it (server/fast_path.py `share_partials`): every layer's q|k|v, o, gate|up and down, the
    per-layer input's gate and projection, the per-layer model projection and the LM head."""
    from server.small_m_matmul import TARGET_PROGRAMS, _block_n, _plan

    def outs(module, *names) -> int:
        return sum(getattr(getattr(module, name, None), "out_features", 0) for name in names)

    shapes = {(vocab, hidden)}
    if ple_dim:
        shapes |= {(ple_dim, hidden), (hidden, ple_dim), (len(layers) * ple_dim, hidden)}
    for hf in layers:
        attn, mlp = hf.self_attn, hf.mlp
        shapes |= {(outs(attn, "q_proj", "k_proj", "v_proj"), hidden), (hidden, attn.o_proj.in_features),
                   (outs(mlp, "gate_proj", "up_proj"), hidden), (hidden, mlp.down_proj.in_features)}
    need = 0
    for n, k in shapes:
        block_n = _block_n(n)
        if block_n and k % BLOCK_K == 0:
            split = _plan(n, k, block_n, TARGET_PROGRAMS)
            need = max(need, split * MAX_ROWS * n * 4 if split > 1 else 0)
    return need


def fast_memory_needs(model, buckets: tuple = DEFAULT_BUCKETS, prefill_rows: int = DEFAULT_PREFILL_ROWS,
                      lanes: int = 1) -> tuple[int, int]:
    """(bytes per context position, bytes that do not grow with the context) the fast path adds to
    the loaded weights on the GPU, from the model's shape: per position the full layers' K/V, the
    step attention's fp32 scratch (server/step_attention.py: per key chunk and query row) and the
    RoPE tables; fixed: prefill's activations for a piece of `prefill_rows` tokens (hidden states,
    per-layer inputs, q, the MLP, attention scores), its dequantization scratch (the largest int4
    linear), the graphs' shared logits and their pool, the split-K scratch, the sliding rings. The
    int4 weights are counted once: the step layout replaces quanto's (released as it is built).
    `lanes` FastTargets over the weights (server/fast_batch.py) each hold the per-position part,
    the dequantization, split-K and graph buffers and a ring; prefill's activations are counted
    once (one lane prefills at a time); the stacked forward adds its attention scratch for 64 rows
    and its graphs' logits buffer (64 rows)."""
    from server.fast_prefill import score_budget
    from server.step_attention import BLOCK_R, _block_s

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    text = model.model
    elt = text.embed_tokens.weight.element_size()
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    max_bucket = max(buckets)
    per_pos, ring_bytes, widest = 0, 0, 0
    window = int(getattr(cfg, "sliding_window", 0) or 0)
    full_dims, rope_dims = {}, {}
    for hf in text.layers:
        attn = hf.self_attn
        d, kv_heads = attn.head_dim, heads // attn.num_key_value_groups
        widest = max(widest, d)
        sliding = bool(getattr(attn, "sliding_window", None))
        rope_dims[sliding] = d
        if not sliding:
            full_dims[d] = kv_heads
        if getattr(attn, "is_kv_shared_layer", False):
            continue
        if sliding:  # the ring: window + the prefill chunk (FastTarget's default, 512)
            ring_bytes += 2 * kv_heads * (window + max(512, max_bucket)) * d * elt
        else:
            per_pos += 2 * kv_heads * d * elt
    def scratch_per_pos(tokens: int) -> int:  # step attention's fp32 scratch per key slot of full layers
        total = 0
        for d, kv_heads in full_dims.items():
            rows = -(-(tokens * heads // kv_heads) // BLOCK_R) * BLOCK_R
            total += int(kv_heads * rows * (d + 2) * 4 / _block_s(d))
        return total
    per_pos += scratch_per_pos(max_bucket)
    per_pos += sum(2 * d * elt for d in rope_dims.values())   # cos and sin per layer type
    ple = (getattr(cfg, "hidden_size_per_layer_input", 0) or 0) * cfg.num_hidden_layers
    inter = max(getattr(cfg, "intermediate_size", 0) or 0, 1) * (2 if getattr(cfg, "use_double_wide_mlp", False) else 1)
    # a prefill row at its widest (the MLP of a full layer): h, x and the residual's temporaries,
    # q, its normed copy and the attention output, gate|up and their product, the per-layer inputs
    per_row = elt * (5 * hidden + 3 * heads * widest + 3 * inter + ple)
    scores = 2 * score_budget(prefill_rows) * elt                     # scores and probabilities
    vocab = cfg.vocab_size
    dequant = elt * hidden * max(2 * inter, ple, heads * widest * 2)  # the largest int4 W^T (about)
    # the graphs' logits (one buffer per bucket, FastTarget._graph), their pool's intermediates and
    # cuBLAS workspaces
    graphs = sum(max(2, b) for b in buckets) * vocab * elt + 64 * 2**20
    # the split-K scratch: the largest linear's K slices x 64 rows (server/small_m_matmul.py
    # share_partials), at least 16 MiB, the allowance before the slices were planned here
    ple_dim = getattr(cfg, "hidden_size_per_layer_input", 0) or 0
    split_k = max(16 * 2**20, _split_k_bytes(text.layers, hidden, ple_dim, cfg.vocab_size))
    fixed = prefill_rows * per_row + scores + lanes * (dequant + graphs + split_k + ring_bytes)
    per_pos = max(per_pos, 1) * lanes
    if lanes > 1:  # the stacked forward (server/batch_step.py): its attention scratch for 64 rows and
        # its graphs' logits
        per_pos += scratch_per_pos(MAX_ROWS)
        fixed += MAX_ROWS * vocab * elt
    return per_pos, int(fixed)


def plan_fast_memory(model, max_context: int, cap: int | None, prefix_bytes: int | None,
                     gpu_memory: int | None = None, buckets: tuple = DEFAULT_BUCKETS, lanes: int = 1,
                     lm_head: str = "auto") -> FastMemoryPlan:
    """Size the fast path from free GPU memory, or from `gpu_memory` (bytes this process may hold
    on the GPU in all, as nvidia-smi counts it: the loaded weights, the CUDA context and libraries
    (measured now, as the device's used memory less PyTorch's) and CAP_SLACK included:
    --gpu-memory-mb). `lm_head`: "int8" (FastTarget's lm_head_int8: plan without the bf16 head),
    "bf16", or "auto": int8 under a cap where the step kernels can run it (`int8_head_unfit`); a head
    an earlier fast path made int8 stays int8. Then: the model's whole context
    when it fits (or `cap`), after a reserve for what does not grow with the context
    (`fast_memory_needs`, plus 5% of the card as slack without a cap), then the prefix cache:
    `prefix_bytes`, or by default 40% of what remains. Without a cap the context takes at most half
    of the room (the prefix cache gets the rest, as before), and prefill keeps a dense bf16 copy of
    the int4 weights when it takes under a quarter of free memory; under a cap the context comes
    first: prefill runs in the largest pieces (8192, 4096, 2048 or 1024 tokens) that let the asked
    context fit, and the dense copy is kept only if it still fits beside that context. `lanes`: that
    many FastTargets over the weights (server/fast_batch.py), each with its own cache, scratch and
    graphs: all of them fit, at one context."""
    dev = model_device(model)
    free, total = torch.cuda.mem_get_info(dev)
    held = torch.cuda.memory_allocated(dev)  # the loaded weights (host tables excluded: not here)
    outside = outside_memory(dev) + (0 if _warmed_up else FRESH_CONTEXT_GROWTH)
    if lm_head not in ("auto", "bf16", "int8"):
        raise ValueError(f"lm_head {lm_head!r}: auto, bf16 or int8")
    unfit = int8_head_unfit(model)
    if lm_head == "int8" and unfit is not None:
        raise ValueError(f"--lm-head int8: {unfit}")
    already = hasattr(model.lm_head, "_sailfish_int8")  # an earlier fast path made it: every later one uses it
    head_int8 = already or lm_head == "int8" or (lm_head == "auto" and gpu_memory is not None and unfit is None)
    saved = int8_head_saving(model) if head_int8 else 0
    held -= saved
    free += saved  # the bf16 table leaves the card before anything planned here is allocated
    asked_cap = gpu_memory
    if gpu_memory is not None:  # the cap counts what nvidia-smi shows: the context and the slack too
        gpu_memory = int(gpu_memory) - outside - CAP_SLACK
    context = min(max_context, cap or max_context)
    rows = DEFAULT_PREFILL_ROWS
    lanes = max(1, int(lanes))

    def needs(rows: int) -> tuple[int, int]:
        return fast_memory_needs(model, buckets, prefill_rows=rows, lanes=lanes)

    per_pos, fixed = needs(rows)
    if gpu_memory is not None:  # the largest prefill piece that lets the whole asked context fit
        room = min(free, int(gpu_memory) - held)
        while rows > SMALL_PREFILL_ROWS and room - fixed < per_pos * context:
            rows //= 2
            per_pos, fixed = needs(rows)
    dense = 2 * _int4_weights(model)
    if gpu_memory is None:
        reserve = fixed + int(0.05 * total)
        room = free - reserve
        use_dense = dense > 0 and dense < 0.25 * free
        if use_dense:
            room -= dense
        if per_pos * context > 0.5 * room:
            context = max(1024, int(0.5 * room / per_pos) // 1024 * 1024)
        what = f"{free / GIB:.1f} GiB free at start-up"
    else:
        reserve = fixed
        room = min(free, int(gpu_memory) - held) - reserve
        if lanes > 1 and per_pos * 1024 > room:
            raise ValueError(f"{lanes} lanes (--parallel {lanes}) do not fit the fast path under a cap of "
                             f"{asked_cap / GIB:.2f} GiB: each needs its own cache and buffers, "
                             f"{(per_pos * 1024 + reserve) / GIB:.2f} GiB for 1024 tokens of context beside "
                             f"{held / GIB:.2f} GiB of weights; ask for fewer lanes or more memory")
        if per_pos * context > room:
            context = max(1024, int(room / per_pos) // 1024 * 1024)
        use_dense = dense > 0 and room - per_pos * context >= dense
        if use_dense:
            room -= dense
        what = (f"cap {asked_cap / GIB:.2f} GiB (--gpu-memory-mb) less "
                f"{outside / GIB:.2f} GiB of CUDA context and libraries"
                + ("" if _warmed_up else f" ({FRESH_CONTEXT_GROWTH / GIB:.2f} of it their growth at warm-up, expected)")
                + f" and {CAP_SLACK / GIB:.2f} GiB of slack, "
                f"{held / GIB:.2f} GiB of weights, {free / GIB:.1f} GiB free")
    left = max(0, room - per_pos * context)
    budget = int(0.4 * left) if prefix_bytes is None else int(prefix_bytes)
    if gpu_memory is not None:
        budget = min(budget, left)  # kept sequences live on the GPU too: inside the cap
    note = (f"{what}; static KV and step scratch {per_pos * context / GIB:.2f} GiB for {context} tokens"
            + (f" in {lanes} lanes" if lanes > 1 else "") + "; "
            f"reserve {reserve / GIB:.2f} GiB (prefill in pieces of {rows} tokens, graphs, scratch)"
            + (f"; dense prefill copy {dense / GIB:.2f} GiB" if use_dense else "")
            + (f"; LM head int8 ({saved / GIB:.2f} GiB freed, the input embedding on the host)" if saved
               else "; LM head int8 (made by an earlier fast path)" if head_int8 else ""))
    return FastMemoryPlan(context, budget, note, rows, use_dense, reserve, per_pos, lanes, head_int8, asked_cap, outside)


def settle_after_warmup(fast, plan: FastMemoryPlan) -> str:
    """Under a cap, after the fast path's warm-up (graphs and a prefill: FastTarget.warm_prefill):
    what the CUDA context and libraries grew by past the plan's figure (the measured context plus
    FRESH_CONTEXT_GROWTH in a process not yet warmed up) is taken back from the prefix cache's budget, the one planned part that can shrink without a
    rebuild. The note says what was measured, and by how much serving may still go over the cap's
    count when the budget could not absorb it. Empty without a cap or off CUDA."""
    global _warmed_up
    if fast.device.type == "cuda":
        _warmed_up = True
    if plan.cap is None or fast.device.type != "cuda":
        return ""
    outside = outside_memory(fast.device)
    note = (f"CUDA context and libraries planned at {plan.outside / GIB:.2f} GiB (with its expected growth), "
            f"{outside / GIB:.2f} GiB after warm-up")
    grew = outside - plan.outside
    if grew <= 0:
        return note
    store = fast.store
    taken = min(grew, store.budget) if store is not None else 0
    if taken:
        store.budget -= taken
        note += f"; the prefix cache's budget gave back {taken / GIB:.2f} GiB (now {store.budget / GIB:.2f} GiB)"
    if grew > taken:
        note += (f"; serving may go {(grew - taken) / GIB:.2f} GiB past the {plan.cap / GIB:.2f} GiB cap "
                 f"(beyond its {CAP_SLACK / 2**20:.0f} MiB of slack): lower --gpu-memory-mb or --fast-max-context")
    return note
