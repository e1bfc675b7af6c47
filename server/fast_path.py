"""A fast Gemma 4 text forward for the GPU: static KV cache, rollback by position, CUDA graphs.

Contract: `FastTarget(model, max_len)` wraps a loaded `Gemma4ForCausalLM` (dense, or frozen
optimum-quanto int4 weights) and shares its weights (no copy). It runs greedy-decoding primitives
with the same meaning as `server/engine.py`'s functions:

- `reset()` starts a request (position 0); `prefill(ids) -> logits[vocab]` of the last prompt token;
- `step(ids, parents=None) -> logits[len(ids), vocab]` appends 1..max_bucket tokens at the current
  position: a chain, or with `parents` a token tree (server/backend.py states the contract: row j
  sits at position + depth(j), sees the cache before the step and its ancestors, and writes its K/V
  at the slot of position + j); `position` advances by len(ids) either way;
- `keep_path(path)` right after a tree step keeps the rows of one root path: their K/V move to
  consecutive slots, and the cache is what a chain step of those tokens and a rollback would leave;
- `step_after_argmax(logits) -> (token, logits)`: plain greedy decoding's next step, launched from
  the argmax of `logits` on the device before the host reads it (`chains_steps`: captured graphs);
- `rollback(n)` forgets the last n positions: the cache keeps every slot, masks hide positions past
  the current one, so rolling back only moves `pos`.

The forward is written out here (embedding and per-layer embeddings, RMSNorm, RoPE, attention with
sliding/full layers and KV sharing, MLP, soft-capped tied LM head) on top of the HF modules'
weights and norms, because transformers' own forward cannot be captured (`StaticCache` initializes
lazily inside `update`) and torch.compile cannot trace quanto's int4 tensor subclass. Without step
kernels, int4 layers call `aten._weight_int4pack_mm` (tinygemm, what quanto itself calls) on
quanto's packed int4 tensors. The linear layers' wrappers are server/fast_linears.py's, the
elementwise ops (norms, RoPE, masks, their compiled forms) server/fast_ops.py's.

One int4 layout: with step kernels on int4 weights, each layer's weights are re-laid out once for
the step kernels (server/small_m_matmul.py) and prefill reads that layout too (each linear
dequantized into one shared bf16 scratch, then cuBLAS: server/fast_prefill.py). Once a layer is
re-laid out, quanto's packed tensors of it are released from the GPU (`release_weights`, default
on): the model's quantized linear modules keep only a meta-device placeholder and the re-laid-out
tensors (`ReleasedLinear`), so a later FastTarget on the same model reuses them without a copy,
and transformers' own forward of the model no longer runs (the fast path owns the model, as
`HostRowTable` does the per-layer table). Prefill runs in pieces of `prefill_rows` tokens, which
bounds its activations whatever the prompt's length; server/fast_memory.py's `plan_fast_memory`
sizes the context, the LM head and the prefix cache from free memory or a cap (`--gpu-memory-mb`).
Under a cap the LM head is int8 (`lm_head_int8`, `_int8_head`) and the token embedding is looked up
on the host like the per-layer one. A table on the host is read by the GPU in place where it can be
(server/host_rows.py, `map_host_tables`: a kernel inside the step's graph), else its rows are staged
(gathered on the host and copied before each replay: `ple_staged`, `embed_staged`).

Steps (decode and verify, 2..64 rows) on CUDA with bf16 activations run on Sailfish's Triton step
kernels (`step_kernels`, on by default where they apply; `step_kernel_note` says which and why):
server/small_m_matmul.py (int4 re-laid out once, a bf16 or int8 LM head) and server/step_attention.py. They
cost about the same for 2 and 16 rows (tinygemm's cost grows with rows; bench/results/gpu_cost_curve.md
has the curve to 64) and are batch-invariant: a token's logits are bit-identical in a 64-token
verify and in a one-token step, so drafted decoding
equals plain decoding on this path, near-tied argmaxes included. 1-token steps run as 2-token
steps (see `__init__`). Without them (CPU, fp32, other shapes) steps use tinygemm/cuBLAS.

Cache layout, per layer that owns keys (KV-shared layers read their source layer's cache):
- full attention: slot = position, `max_len` slots; a graph reads only the first `kv_len` slots,
  `kv_len` a power-of-two bucket >= pos + tokens (one graph per (tokens, kv_len) bucket);
- sliding attention: a ring of `window + chunk` slots, slot = position % ring; `slot_pos` records
  which position each slot holds. Invariant: every position a query may see (q - window < k <= q)
  is still in the ring, because nothing written is ever more than `chunk` ahead of the committed
  position (prefill writes at most `chunk` tokens a forward; steps at most `max_bucket <= chunk`).

Steps of 1..max_bucket tokens are padded to a bucket (1, 2, 4, 8, 16, 32, 64 by default); on CUDA each
(bucket, kv_len) pair is captured once as a CUDA graph (`capture=True`), so a step is two small
host-to-device copies, one graph replay and one device-to-host copy. The padding tokens' keys land
past the committed position, where masks hide them until they are overwritten.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ngram.draft import tree_layout
from server import step_norms
from server.backend import Prefill
from server.fast_linears import DenseLinear, Int4Linear, ReleasedLinear, as_linear, fuse_int4, release_module, released_parts
from server.fast_ops import _EAGER_OPS, _attention, _compiled_ops
from server.fast_prefill import _eps, _w, prefill_layers
from server.host_rows import HostRowTable, embed_scale
from server.sampling import row_argmax
from server.small_m_matmul import MAX_ROWS, triton_available
from server.step_attention import chain_ancestors, chain_paths

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, MAX_ROWS)  # the largest is what the step kernels take: drafts of up to 63
DEFAULT_PREFILL_ROWS = 8192   # prompt tokens per prefill_layers call (bounds prefill's activations)
# A prompt's uncached remainder of at most this many of the largest steps runs as steps (the captured
# step graphs) instead of prefill_layers: on the H200 (E4B shape, int4) an eager prefill of 64 new
# tokens took 70-90 ms, launch-bound (README, several requests), a captured 16-row step ~5 ms and
# a 64-row one ~11 ms. An agent's next turn (the conversation cached, a tool result new) is this case.
PREFILL_BY_STEPS_MAX = 6
SMALL_PREFILL_ROWS = 1024     # the smallest piece plan_fast_memory picks under a memory cap
# Steps run the MLP's and the per-layer input's gelu_tanh(a) * b in the epilogue of the matmul that
# computes a (server/small_m_matmul.py GELU_PAIRS / GELU_TIMES): up to two launches a layer fewer (E4B:
# 84 of 705 at one row), the same bf16 results. False: the separate compiled kernel (A/B runs).
FUSED_GELU = True
# The per-layer input gate's gelu is fused only into steps of at most this many rows: its matmul
# (E4B: 256 columns, 20 K slices) runs the epilogue in the one program of a column tile that sums
# the slices, which past 16 rows took longer than the separate kernel (H200, cold weights, 1 / 16 /
# 32 / 64 rows: 3.8 / 5.2 / 8.2 / 13.7 us fused against 4.1 / 5.4 / 7.5 / 11.5;
# `python -m bench.small_m_bench --epilogues`). Same bits either way.
PLE_GELU_FUSED_ROWS = 16
# Steps sum a split-K matmul's K slices in the kernel that reads its output (the q/k/v norms and
# RoPE, the residual norms, the per-layer inputs: the `summed_*` ops below), not in the matmul's
# last program (server/small_m_matmul.py `slices`): the same sum in the same order, the matmul
# without its counter, fence and serial tail (bench.small_m_bench --chain-tails: the tails cost
# 0.39 ms of a one-row step's E4B matmuls, 1.27 ms of a 16-row verify's). On since 12-05: on the H100
# a one-token step 3.58 -> 3.51 ms, a 16-token verify 4.34 -> 4.13, 4 lanes' stacked forwards 6.11-6.21
# -> 5.57-5.91 ms (bench/results/step_ab-summed-h100.md, gpu_concurrency-summed-ab.md). With it on,
# these CUDA tests passed: test_fast_batch.py's, test_fast_tree.py's, and test_fast_path.py's
# drafted-equals-plain, batch-invariance and summed-slices ones (its other CUDA tests, and those of
# test_host_rows.py, test_int8_head.py, test_early_launch.py and test_prefix_cache.py, have not run
# with it on yet). False: the matmuls sum their own slices (A/B runs).
SUMMED_SLICES = True
# With the summed slices, the residual norms run on one Triton kernel of their own, a program a row
# holding the row in registers (server/step_norms.py), instead of the compiled ops, looped
# reductions that recompute the row's slice sums in each pass; and an attention layer's q / k / v norms and RoPE on one
# launch a layer (`summed_qkv_norm_rope`), where the compiled ops took three for a layer owning its
# K/V. Only where the ops are compiled (fuse, the CUDA default): uncompiled, they are the ops as
# written. On since 12-06 (stop 60): on an H100 (E4B shape, one round of `python -m bench.step_ab
# --base-tree . --base-set server.fast_path.RESIDUAL_NORM_KERNEL=False --base-set
# server.fast_path.QKV_NORM_KERNEL=False --head-set ...=True --head-set ...=True`,
# bench/results/step_ab-norm-kernels-h100.md) a one-token step 3.47 -> 3.17 ms (567 -> 519 kernels;
# the residual norms 0.49 -> 0.38 ms, the q/k/v norms 0.25 -> 0.10), a 16-token verify 4.05 ->
# 3.85, plain decode chained 296 -> 316 tokens/s, drafted equal to plain on both sides.
# False: the compiled ops (A/B runs).
RESIDUAL_NORM_KERNEL = True
QKV_NORM_KERNEL = True
# Plain greedy steps chained on the device (`step_after_argmax`): each launched from the argmax the
# step before left on the GPU, before the host reads that token, so the GPU does not idle between
# steps while the host syncs, stages and replays (0.2-0.5 ms of CPU a replay). False: the token read
# back before the next step is staged (A/B runs).
CHAINED_STEPS = True


def step_buckets(max_draft: int) -> tuple[int, ...]:
    """The buckets a FastTarget needs for drafts of up to `max_draft` tokens: DEFAULT_BUCKETS up to
    the first that holds a step's rows (the pending token and the draft). A larger bucket would never
    run, yet it costs memory that grows with the context (the step attention's fp32 scratch is sized
    for the largest bucket's rows: on E4B 16 KiB a position for 64 rows, 0.5 GiB at 32k) and graph
    captures at start-up. The default draft cap (16) needs up to 32."""
    rows = max(1, max_draft + 1)
    if rows >= DEFAULT_BUCKETS[-1]:
        return DEFAULT_BUCKETS  # the engine caps longer drafts at the largest step (its max_step)
    return tuple(b for b in DEFAULT_BUCKETS if b < rows) + (min(b for b in DEFAULT_BUCKETS if b >= rows),)


# ---------------------------------------------------------------- model description

@dataclass
class _Layer:
    index: int
    sliding: bool
    head_dim: int
    kv_heads: int
    source: int              # layer whose cache this layer reads (itself unless KV-shared)
    q: object
    k: object | None
    v: object | None
    o: object
    gate: object
    up: object
    down: object
    ple_gate: object | None
    ple_proj: object | None
    hf: torch.nn.Module      # the HF decoder layer: norms, layer_scalar, act_fn
    qkv: object | None = None       # fused q|k|v (int4 only), output split by qkv_sizes
    qkv_sizes: tuple = ()
    gate_up: object | None = None   # fused gate|up (int4 only)
    gate_up_gelu: object | None = None  # steps: gate|up computing gelu(gate) * up (SmallMLinear.gelu_pairs)
    step: "_Layer | None" = None    # the same layer with step-kernel linears (see _build_step_kernels)


@dataclass
class StepTimings:
    capture_s: float = 0.0
    graphs: int = 0
    prefill_s: float = 0.0
    extra: dict = field(default_factory=dict)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def unsupported_reason(model) -> str | None:
    """None when FastTarget can run `model`; otherwise why not (for the engine's start-up notes)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kind = getattr(cfg, "model_type", "?")
    if kind != "gemma4_text" or not hasattr(getattr(model, "model", None), "layers"):
        return f"the fast path supports Gemma 4 text models only (this is {kind})"
    if getattr(cfg, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        return f"activation {cfg.hidden_activation} is not supported by the fast path"
    if getattr(cfg, "enable_moe_block", False):
        return "Gemma 4 MoE layers are not supported by the fast path"
    return None


def model_device(model) -> torch.device:
    """The device the model computes on: its first parameter neither on the host (a fast path moves
    embedding tables there: HostRowTable) nor on the meta device (weights a fast path released:
    release_module), else the first."""
    params = list(model.parameters())
    return next((p.device for p in params if p.device.type not in ("cpu", "meta")), params[0].device)


class FastTarget:
    def __init__(self, model, max_len: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 prefill_chunk: int = 512, capture: bool | None = None, min_kv_len: int | None = None,
                 fuse: bool | None = None, fuse_proj: bool = True, step_kernels: bool | None = None,
                 prefix_budget_bytes: int = 0, checkpoint_every: int | None = None,
                 prefill_dense: bool | None = None, ple_on_host: bool = False,
                 prefill_rows: int = DEFAULT_PREFILL_ROWS, release_weights: bool = True,
                 prefix_store=None, lm_head_int8: bool = False, prefill_by_steps: int | None = None,
                 map_host_tables: bool | None = None):
        # what another lane over this model is built with (server/fast_batch.py)
        self.settings = dict(max_len=max_len, buckets=buckets, prefill_chunk=prefill_chunk, capture=capture,
                             min_kv_len=min_kv_len, fuse=fuse, fuse_proj=fuse_proj, step_kernels=step_kernels,
                             checkpoint_every=checkpoint_every, prefill_dense=prefill_dense, ple_on_host=ple_on_host,
                             prefill_rows=prefill_rows, release_weights=release_weights, lm_head_int8=lm_head_int8,
                             prefill_by_steps=prefill_by_steps, map_host_tables=map_host_tables)
        lm = model
        self.model = model
        text = lm.model
        cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        if getattr(cfg, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise NotImplementedError(f"activation {cfg.hidden_activation} is not supported by the fast path")
        if getattr(cfg, "enable_moe_block", False):
            raise NotImplementedError("Gemma 4 MoE layers are not supported by the fast path")
        self.cfg = cfg
        self.device = model_device(lm)
        self.embed = text.embed_tokens
        self.dtype = self.embed.weight.dtype
        self.buckets = tuple(sorted(buckets))
        self.max_bucket = self.buckets[-1]
        self.chunk = max(prefill_chunk, self.max_bucket)
        self.window = int(cfg.sliding_window)
        self.ring = self.window + self.chunk
        self.max_len = int(max_len)
        # Full layers read kv_len = max_len slots unless min_kv_len asks for smaller buckets: one
        # graph per step bucket; the extra K/V bytes are small next to the weights (E4B: ~0.26 GB at 9k).
        self.min_kv_len = self.max_len if min_kv_len is None else min(min_kv_len, self.max_len)
        self.capture = (self.device.type == "cuda") if capture is None else capture
        # prompt remainders of at most this many tokens run as steps (start); by default only where
        # steps are captured graphs, which is where they are cheaper than an eager prefill
        self.prefill_by_steps = (PREFILL_BY_STEPS_MAX * self.max_bucket if self.capture else 0) \
            if prefill_by_steps is None else int(prefill_by_steps)
        fuse = (self.device.type == "cuda") if fuse is None else fuse
        self.ops = _compiled_ops() if fuse else _EAGER_OPS
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.num_heads = cfg.num_attention_heads
        self.n_layers = cfg.num_hidden_layers

        self.ple_dim = getattr(cfg, "hidden_size_per_layer_input", 0) or 0
        self.ple_on_host = bool(self.ple_dim) and ple_on_host
        self.map_host_tables = map_host_tables  # None: where the GPU can read them in place (server/host_rows.py)
        if self.ple_dim:
            # on the host (the engine's choice: frees 5.25 GiB on E4B) or the module itself
            self.embed_ple = (HostRowTable(text.embed_tokens_per_layer, self.device, map_host_tables) if ple_on_host
                              else text.embed_tokens_per_layer)
            self.ple_model_proj = as_linear(text.per_layer_model_projection)
            self.ple_model_proj_scale = text.per_layer_model_projection_scale
            self.ple_norm = text.per_layer_projection_norm
            self.ple_input_scale = text.per_layer_input_scale
        # a step's per-layer rows gathered on the host and copied into ple_buf before each replay
        # (a table in host memory the GPU cannot read in place), else looked up inside the graph
        self.ple_staged = self.ple_on_host and not self.embed_ple.mapped
        self.final_norm = text.norm
        self.lm_head = as_linear(lm.lm_head)

        self.layers = self._describe_layers(text, cfg)
        self.prefill_rows = max(1, int(prefill_rows))
        from server.fast_prefill import score_budget
        self.score_budget = score_budget(self.prefill_rows)
        self.release_weights = release_weights
        self.released_bytes = 0      # quanto tensors freed from the GPU once re-laid out (see _build_step_kernels)
        self.prefill_scratch_bytes = 0
        self.step_kernels, self.step_kernel_note = self._want_step_kernels(step_kernels)
        self.fused_gelu = False   # steps' gelus in the matmuls' epilogues (FUSED_GELU; step kernels only)
        self.summed_slices = False  # steps' split-K sums in the ops that read them (SUMMED_SLICES; likewise)
        self.norm_kernel = False  # the summed residual norms on server/step_norms.py (RESIDUAL_NORM_KERNEL)
        self.qkv_kernel = False   # the summed q / k / v norms there too (QKV_NORM_KERNEL)
        self.lm_head_capped = None  # the step LM head soft-capping in its store (step kernels only)
        self.embed_on_host = self.embed_staged = False  # the token embedding likewise (_int8_head)
        if lm_head_int8 or hasattr(lm.lm_head, "_sailfish_int8"):  # asked, or an earlier fast path made it
            self._int8_head(lm, text)
        if not self.step_kernels and any(isinstance(lin, ReleasedLinear) for lin in self._all_linears()):
            self.step_kernel_note += ("; int4 weights from the step-kernel layout (an earlier fast path released "
                                      "quanto's), dequantized per call for cuBLAS")
        if fuse_proj and not self.step_kernels:  # with step kernels, prefill uses the model's own layers
            self._fuse_projections()
        self.fused_layers = sum(layer.qkv is not None or layer.gate_up is not None for layer in self.layers)
        self._build_rope(text, cfg)
        self._allocate()
        if self.step_kernels:
            # torch.compile specializes a dimension of size 1, so 1-token steps would get fused
            # elementwise kernels of their own (another reduction order in the norms): steps run with
            # at least 2 rows (one padding token; the step kernels cost the same for 1 and 2 rows),
            # so every step shares one compiled kernel per op and stays batch-invariant.
            self.buckets = tuple(sorted({max(2, b) for b in self.buckets}))
            self.fused_gelu = FUSED_GELU   # read once: the step layers are built for it
            self.summed_slices = SUMMED_SLICES  # read once, so a captured graph and a later step agree
            # (uncompiled ops, fuse=False, stay the ops as written: the reference the tests compare with)
            compiled = self.summed_slices and self.ops is not _EAGER_OPS and self.device.type == "cuda"
            self.norm_kernel = compiled and RESIDUAL_NORM_KERNEL
            self.qkv_kernel = compiled and QKV_NORM_KERNEL
            self._build_step_kernels()
        from server.fast_prefill import keep_dense_weights
        self.prefill_note = keep_dense_weights(self, prefill_dense) if self.step_kernels else "prefill: model's own layers"
        if self.released_bytes and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the released quanto tensors' blocks back to the card
        self.max_step = self.max_bucket
        self.max_context = self.max_len - self.max_bucket  # a padded step writes up to a bucket past
        self.first_sliding_source = min((l.index for l in self.layers if l.sliding and l.source == l.index),
                                        default=-1)
        from server.fast_prefix import DEFAULT_CHECKPOINT_EVERY, FastPrefixCache
        self.checkpoint_every = checkpoint_every or DEFAULT_CHECKPOINT_EVERY
        self.prefix = FastPrefixCache(self, prefix_budget_bytes, self.checkpoint_every, store=prefix_store)
        self.batch = None  # server.fast_batch.FastBatch, once fast_lanes made this a lane: steps shared
        self._joined = False
        self._others = (0, 0)  # (lanes, rows) that shared this lane's last forward (shared_load)
        self.pos = 0
        self._keep = False
        self._last_step = None  # (start, ids, bucket, parents) of the last step, for keep_path
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        self._graph_out: dict[int, torch.Tensor] = {}
        self.timings = StepTimings()

    # ------------------------------------------------------------ set-up

    def _describe_layers(self, text, cfg) -> list[_Layer]:
        types = list(cfg.layer_types)
        first_shared = self.n_layers - (getattr(cfg, "num_kv_shared_layers", 0) or 0)
        layers = []
        for i, hf in enumerate(text.layers):
            attn, mlp = hf.self_attn, hf.mlp
            shared = bool(getattr(attn, "is_kv_shared_layer", False))
            if shared:  # reuse the last layer of the same type before the first shared one
                source = max(j for j in range(first_shared) if types[j] == types[i])
            else:
                source = i
            kv_heads = cfg.num_attention_heads // attn.num_key_value_groups
            layers.append(_Layer(
                index=i, sliding=types[i] == "sliding_attention", head_dim=attn.head_dim, kv_heads=kv_heads,
                source=source, q=as_linear(attn.q_proj),
                k=None if shared else as_linear(attn.k_proj),
                v=None if shared or getattr(attn, "v_proj", None) is None else as_linear(attn.v_proj),
                o=as_linear(attn.o_proj), gate=as_linear(mlp.gate_proj), up=as_linear(mlp.up_proj),
                down=as_linear(mlp.down_proj),
                ple_gate=as_linear(hf.per_layer_input_gate) if self.ple_dim else None,
                ple_proj=as_linear(hf.per_layer_projection) if self.ple_dim else None, hf=hf))
        return layers

    def _fuse_projections(self) -> None:
        """q/k/v and gate/up as one int4 matmul each (fewer kernels a step); dense layers stay apart."""
        for layer in self.layers:
            parts = [p for p in (layer.q, layer.k, layer.v) if p is not None]
            if len(parts) > 1 and (fused := fuse_int4(parts)) is not None:
                layer.qkv, layer.qkv_sizes = fused, tuple(p.out_features for p in parts)
            if (fused := fuse_int4([layer.gate, layer.up])) is not None:
                layer.gate_up = fused

    def _want_step_kernels(self, asked: bool | None) -> tuple[bool, str]:
        """Whether steps run on the batch-invariant Triton kernels (server/small_m_matmul.py,
        server/step_attention.py), and why or why not (for the start-up notes)."""
        if asked is False:
            return False, "step kernels off (asked)"
        why_not = None
        if self.device.type != "cuda":
            why_not = "step kernels need CUDA"
        elif self.dtype != torch.bfloat16:
            why_not = f"step kernels need bf16 activations (model is {self.dtype})"
        elif self.max_bucket > MAX_ROWS:
            why_not = f"step kernels take up to {MAX_ROWS} tokens (largest bucket {self.max_bucket})"
        elif not triton_available():
            why_not = "Triton is not installed"
        if why_not is None:
            from server.small_m_matmul import unsupported_shape
            for lin in self._all_linears():
                if (why_not := unsupported_shape(lin)) is not None:
                    break
        if why_not is not None:
            if asked:
                raise ValueError(why_not)
            return False, f"{why_not}: steps use tinygemm/cuBLAS (not batch-invariant)"
        return True, "batch-invariant Triton step kernels (int4 small-M matmul, chunked attention)"

    def _int8_head(self, lm, text) -> None:
        """The LM head as int8 (server/small_m_matmul.quantize_int8: a scale per 128 features and
        column; E4B: 0.63 GiB where the bf16 head takes 1.25) and the input embedding looked up on
        the host (HostRowTable), so the bf16 table leaves the GPU: a tied head (Gemma's) is that
        table. It moves first and is quantized on the host, so the GPU never holds both heads nor
        the quantization's fp32 temporaries. Logits change by the quantization
        (bench/lm_head_quality.py measures how much); drafted output still equals plain output, both
        on this head. The codes and scales are kept on the HF module (`_sailfish_int8`) for the
        other fast paths over this model (lanes), each with a SmallMLinear of its own (its split-K
        counter and scratch). Without step kernels the head is the int8 weights dequantized (on the
        host, then one bf16 copy on the device): the same W, a dense matmul, no memory saved."""
        from server.small_m_matmul import SmallMLinear, quantize_int8

        self.lm_head = None  # (its bf16 weight on the GPU) so that moving the table frees it
        lm.lm_head.to("cpu")  # a tied head takes the table along
        self.embed = HostRowTable(text.embed_tokens, self.device, self.map_host_tables)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        kept = getattr(lm.lm_head, "_sailfish_int8", None)
        if kept is None:  # quantized on the host (E4B: 2-8 s), the codes then copied to the GPU
            host = quantize_int8(lm.lm_head.weight.detach())
            kept = (host.weight, host.scale)
            if self.step_kernels:
                kept = tuple(t.to(self.device) for t in kept)
            lm.lm_head._sailfish_int8 = kept
        codes, scale = kept
        k, n = codes.shape
        if self.step_kernels and codes.device == self.device:
            self.lm_head = SmallMLinear(codes, scale, None, n, k)
        else:
            self.lm_head = DenseLinear(SmallMLinear(codes.cpu(), scale.cpu(), None, n, k).dequantize()
                                       .contiguous().to(self.device))
        self.embed_on_host = True
        self.embed_staged = not self.embed.mapped

    def _all_linears(self) -> list:
        out = [self.lm_head] + ([self.ple_model_proj] if self.ple_dim else [])
        for layer in self.layers:
            out += [p for p in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down,
                                layer.ple_gate, layer.ple_proj) if p is not None]
        return out

    def _build_step_kernels(self) -> None:
        """Each layer gets `step`: a copy of its description whose linears are SmallMLinear (q|k|v
        and gate|up concatenated), and one StepAttention per head size. With `release_weights`, a
        layer's quanto int4 tensors are freed right after its step layout is built (one layer's
        worth of both at a time), and its linears become ReleasedLinear views of that layout."""
        from server.small_m_matmul import as_small_m, concat
        from server.step_attention import StepAttention

        def small_of(parts):  # one SmallMLinear computing the parts side by side, or None
            reused = released_parts(parts)
            if reused is not None:
                return reused
            smalls = [as_small_m(p) for p in parts]
            return smalls[0] if len(smalls) == 1 else concat(smalls)

        self.released_bytes = 0
        for layer in self.layers:
            # q|k|v and gate|up are concatenated from temporary parts, which are not kept: there the
            # step view keeps the model's own layers, for their sizes (a step calls the fused one).
            small = {name: small_of([getattr(layer, name)]) if getattr(layer, name) is not None else None
                     for name in ("o", "down", "ple_gate", "ple_proj")}
            for names, fused in ((("q", "k", "v"), "qkv"), (("gate", "up"), "gate_up")):
                parts = {n: getattr(layer, n) for n in names if getattr(layer, n) is not None}
                joined = small_of(list(parts.values())) if len(parts) > 1 else None
                small.update({fused: joined} if joined is not None else {n: small_of([p]) for n, p in parts.items()})
                if fused == "qkv" and joined is not None:
                    small["qkv_sizes"] = tuple(p.out_features for p in parts.values())
            if self.fused_gelu and small.get("gate_up") is not None:
                small["gate_up_gelu"] = small["gate_up"].gelu_pairs()   # the same tensors
            layer.step = replace(layer, **small, step=None)
            if self.release_weights:
                self._release_layer(layer)
        self.lm_head_step = as_small_m(self.lm_head)
        self.ple_model_proj_step = small_of([self.ple_model_proj]) if self.ple_dim else None
        if self.release_weights and self.ple_dim and isinstance(self.ple_model_proj, Int4Linear):
            self.released_bytes += self.ple_model_proj.nbytes()
            self.ple_model_proj = release_module(self.model.model.per_layer_model_projection, self.ple_model_proj_step,
                                                 0, self.ple_model_proj_step.n)
        # One split-K scratch for all of them (they run one after another on one stream): sized for
        # 64 rows, per-linear scratch would be ~1.2 GB on E4B; shared it is the largest one's.
        from server.small_m_matmul import SmallMLinear, share_partials
        every = [self.lm_head_step] + ([self.ple_model_proj_step] if self.ple_dim else [])
        for layer in self.layers:
            every += [v for v in vars(layer.step).values() if isinstance(v, SmallMLinear)]
        self.step_scratch_bytes = share_partials(every)
        # the logits' soft-capping in the LM head's store (its scratch shared too)
        self.lm_head_capped = self.lm_head_step.softcapped(self.softcap) if self.softcap else None
        self.step_attention = {}
        for layer in self.layers:
            d = layer.head_dim
            if d not in self.step_attention:  # one per head size, sized for its largest cache
                slots = max(self.ring if l.sliding else self.max_len for l in self.layers if l.head_dim == d)
                self.step_attention[d] = StepAttention(layer.kv_heads, self.num_heads // layer.kv_heads, d, slots,
                                                       self.max_bucket, self.device)

    def _release_layer(self, layer: _Layer) -> None:
        """Free the quanto tensors of one layer whose step layout is built: every Int4Linear part
        becomes a ReleasedLinear over the step linear (or the columns of the fused one) holding it."""
        hf = layer.hf
        modules = {"q": hf.self_attn.q_proj, "k": getattr(hf.self_attn, "k_proj", None),
                   "v": getattr(hf.self_attn, "v_proj", None), "o": hf.self_attn.o_proj,
                   "gate": hf.mlp.gate_proj, "up": hf.mlp.up_proj, "down": hf.mlp.down_proj,
                   "ple_gate": getattr(hf, "per_layer_input_gate", None), "ple_proj": getattr(hf, "per_layer_projection", None)}
        step = layer.step
        owner = {}   # part name -> (step linear holding it, first column)
        for names, fused in ((("q", "k", "v"), "qkv"), (("gate", "up"), "gate_up")):
            joined = getattr(step, fused)
            at = 0
            for n in names:
                part = getattr(layer, n)
                if part is None:
                    continue
                owner[n] = (joined, at) if joined is not None else (getattr(step, n), 0)
                at += part.out_features
        for n in ("o", "down", "ple_gate", "ple_proj"):
            if getattr(layer, n) is not None:
                owner[n] = (getattr(step, n), 0)
        for n, (small, lo) in owner.items():
            part = getattr(layer, n)
            if not isinstance(part, Int4Linear) or getattr(small, "int4", False) is not True:
                continue
            self.released_bytes += part.nbytes()
            released = release_module(modules[n], small, lo, lo + part.out_features)
            setattr(layer, n, released)
            if getattr(step, n) is part:  # the step view keeps the parts of fused linears (for sizes)
                setattr(step, n, released)

    def step_linears(self) -> list:
        """Every step-kernel linear (empty without step kernels)."""
        if not self.step_kernels:
            return []
        out = [self.lm_head_step] + ([self.ple_model_proj_step] if self.ple_dim else [])
        for layer in self.layers:
            out += [p for p in (layer.step.qkv, layer.step.q, layer.step.o, layer.step.gate_up, layer.step.down,
                                layer.step.ple_gate, layer.step.ple_proj) if p is not None and hasattr(p, "int4")]
        return out

    def _build_rope(self, text, cfg) -> None:
        """cos/sin tables for every position, computed by the HF rotary module itself, side by side in
        one table (`rope_table`: a position's cos and sin of each layer kind in one row), so a step
        looks its positions up in one launch (`rope_rows`)."""
        n = self.max_len + self.chunk
        positions = torch.arange(n, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        parts, self._rope_columns = [], {}
        at = 0
        for layer_type in sorted(set(cfg.layer_types)):
            cos, sin = (t[0] for t in text.rotary_emb(probe, positions, layer_type))
            d = cos.shape[-1]
            self._rope_columns[layer_type == "sliding_attention"] = (slice(at, at + d), slice(at + d, at + 2 * d))
            parts += [cos, sin]
            at += 2 * d
        self.rope_table = torch.cat(parts, 1).contiguous()
        # the Triton gather (server/host_rows.py gather_rows) on any CUDA device with Triton (a copy of
        # rows: any dtype, with or without the step kernels); index_select elsewhere
        self._rope_gather = self.device.type == "cuda" and triton_available()
        # the token embedding's scale as its module applies it (a bf16 scalar times bf16 rows), read
        # once here (a graph's capture cannot read a GPU tensor): for the steps' gather of its rows
        scale = embed_scale(self.embed, self.dtype)
        self._embed_scale = None if scale is None else float(scale)

    def rope_rows(self, pos: torch.Tensor) -> dict:
        """{sliding: (cos, sin)}, each [T, 1, D], for positions `pos` [T] (on the device): one
        gather of `rope_table`'s rows (one launch on CUDA), the kinds' columns views of it."""
        if self._rope_gather:
            from server.host_rows import gather_rows
            rows = gather_rows(self.rope_table, pos, self.device)
        else:
            rows = self.rope_table.index_select(0, pos)
        return {s: (rows[:, c][:, None, :], rows[:, n][:, None, :]) for s, (c, n) in self._rope_columns.items()}

    def _allocate(self) -> None:
        dev, dt = self.device, self.dtype
        self.k_cache: dict[int, torch.Tensor] = {}
        self.v_cache: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            if layer.source == layer.index:
                slots = self.ring if layer.sliding else self.max_len
                shape = (layer.kv_heads, slots, layer.head_dim)
                self.k_cache[layer.index] = torch.zeros(shape, dtype=dt, device=dev)
                self.v_cache[layer.index] = torch.zeros(shape, dtype=dt, device=dev)
        self.slot_pos = torch.full((self.ring,), -1, dtype=torch.long, device=dev)
        self.full_pos = torch.arange(self.max_len, device=dev)
        # Static step inputs of up to max_bucket tokens, the rows of one buffer that a step fills
        # with one copy from the host rows `_host_in` (written through the numpy view `_host_np`:
        # a few numpy writes cost what one torch op's dispatch does): ids, positions, and
        # anc_buf[t]: bit j set iff step row j is t or one of its ancestors (a chain: rows 0..t).
        pin = dev.type == "cuda"
        self._host_in = torch.zeros(3, self.max_bucket, dtype=torch.long, pin_memory=pin)
        self._host_np = self._host_in.numpy()
        # step_after_argmax's: two pinned copies of the host rows (a chained step's are copied without
        # blocking, so the next one writes the other; the host has waited for a later token before it
        # writes one again) and, beside each, a chosen token's pinned copy and the event of its read
        self._chain_host = [torch.zeros(3, self.max_bucket, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._chain_token = [torch.zeros(1, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._chain_read = [torch.cuda.Event() for _ in range(2)] if dev.type == "cuda" else []
        self._chain_slot = 0
        self._in_buf = torch.zeros(3, self.max_bucket, dtype=torch.long, device=dev)
        self.ids_buf, self.pos_buf, self.anc_buf = self._in_buf.unbind(0)
        self._chain_anc = torch.tensor(chain_ancestors(self.max_bucket), dtype=torch.long)
        self._chain_anc_np = self._chain_anc.numpy()
        self._rows_np = np.arange(self.max_bucket, dtype=np.int64)  # a chain step's rows 0..T-1
        self.anc_buf.copy_(self._chain_anc)  # never an alias of the chain masks
        # path_buf[t, j]: the row of t's ancestor at depth j (a chain: j), what the step kernels read;
        # written only when a step's tree differs from what it holds (chain steps copy nothing)
        self._chain_path = chain_paths(self.max_bucket)
        self.path_buf = self._chain_path.to(dev, copy=True)
        self._host_path = torch.zeros(self.max_bucket, self.max_bucket, dtype=torch.long, pin_memory=pin)
        self._path_is_chain = True
        self.row_index = torch.arange(self.max_bucket, device=dev)  # a step's row j writes at slot pos[0] + j
        if self.ple_staged:  # a step's per-layer embedding rows, written before each replay
            self.ple_buf = torch.zeros(self.max_bucket, self.embed_ple.width, dtype=self.embed_ple.dtype, device=dev)
        if self.embed_staged:  # a step's embedding rows, likewise
            self.embed_buf = torch.zeros(self.max_bucket, self.embed.width, dtype=self.embed.dtype, device=dev)

    @property
    def async_steps(self) -> bool:
        """A step returns before its forward has run (a graph replay), until its logits are read:
        the engine launches each step before handing out the text before it (server/engine.py).
        A lane's step waits for its shared forward."""
        return self.capture and self.batch is None

    @property
    def host_table_note(self) -> str | None:
        """Which embedding tables live in host memory and how a step reads them (None: neither)."""
        tables = [(name, table) for name, table, on in (("per-layer embeddings", getattr(self, "embed_ple", None),
                                                         self.ple_on_host),
                                                        ("token embedding", self.embed, self.embed_on_host)) if on]
        return "; ".join(f"{name} in host memory, {table.note}" for name, table in tables) or None

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_cache.values(), *self.v_cache.values()))

    # ------------------------------------------------------------ the forward

    @property
    def summed_residual_ops(self):
        """What a step's summed residual norms run on: server/step_norms.py's kernel, or the ops (the
        same signatures)."""
        return step_norms if self.norm_kernel else self.ops

    @property
    def summed_qkv_ops(self):
        """Likewise for a step's summed q / k / v norms."""
        return step_norms if self.qkv_kernel else self.ops

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, kv_len: int, step: bool = False,
                 segments: list["Segment"] | None = None, ple_rows: torch.Tensor | None = None,
                 embed_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] for tokens `ids` [T] at positions `pos` [T]; writes their K/V.
        `step`: a decode/verify step (a chain, or a tree described by anc_buf and path_buf; positions by depth,
        row j's K/V at slot pos[0] + j), run on the step kernels when they are on. Otherwise the
        positions are consecutive.

        `segments`: the rows belong to several sequences, each a FastTarget over this model's weights
        with a cache of its own (server/fast_batch.py): segment s's rows lo..hi-1 are a step of
        s.target at its kv_len, read its anc_buf / path_buf, write and attend to its cache only.
        Default: every row is this target's, at `kv_len`. Everything but the cache writes and the
        attention runs once over all rows, and is per row (the step kernels are batch-invariant),
        so a sequence's logits do not depend on the others. `ple_rows`, `embed_rows`: the per-layer
        and the token embedding rows of a step whose tables are on the host (default: this
        target's ple_buf, embed_buf)."""
        ops = self.ops
        T = ids.shape[0]
        from_buffers = step  # a step()'s inputs: staged tables' rows are in ple_buf / embed_buf
        step = step and self.step_kernels
        # On the step kernels, a split-K matmul's output is its K slices' partials, summed by the op
        # that reads it (the summed_* ops; server/small_m_matmul.py `slices`)
        sums = step and self.summed_slices
        out_of = (lambda lin, a: lin.slices(a)) if sums else (lambda lin, a: lin(a))   # what the next op reads
        summed = self.summed_residual_ops
        residual_norm = summed.summed_residual_norm if sums else ops.residual_norm
        residual_norm_rms = summed.summed_residual_norm_rms if sums else ops.residual_norm_rms
        segments = segments if segments is not None else [Segment(self, 0, T, kv_len)]
        if from_buffers and self.embed_staged:
            h = self.embed_buf[:T] if embed_rows is None else embed_rows  # [T, hidden]
        elif step and not self.embed_on_host and self._rope_gather:
            # the rows by the Triton gather (one short kernel; torch's index_select took 11 us for a
            # verify's 16 rows on an H100), times the module's embed_scale, rounded as the module rounds
            from server.host_rows import gather_rows
            h = gather_rows(self.embed.weight, ids, self.device, self._embed_scale)
        else:
            h = self.embed(ids)
        if self.ple_dim:
            if from_buffers and self.ple_staged:
                rows = self.ple_buf[:T] if ple_rows is None else ple_rows
            else:
                rows = self.embed_ple(ids)
            tok = rows.reshape(T, self.n_layers, self.ple_dim)
            proj = out_of(self.ple_model_proj_step if step else self.ple_model_proj, h)
            ple = (ops.summed_ple_inputs if sums else ops.ple_inputs)(
                proj.unflatten(-1, (self.n_layers, self.ple_dim)), self.ple_model_proj_scale, _w(self.ple_norm),
                _eps(self.ple_norm), tok, self.ple_input_scale)
        for seg in segments:
            seg.prepare(pos, from_buffers, step, ops)
        cos_sin = self.rope_rows(pos)

        # Each RMSNorm that reads the residual stream runs in the kernel that last wrote it
        # (residual_norm_rms): a layer's input norm in the previous layer's last one, the final norm
        # in the last layer's. Only the first layer's input norm runs on its own.
        first = self.layers[0].hf.input_layernorm
        x = ops.rms(h, _w(first), _eps(first))
        for i, layer in enumerate(self.layers):
            if step:
                layer = layer.step
            hf = layer.hf
            cos, sin = cos_sin[layer.sliding]
            next_norm = self.layers[i + 1].hf.input_layernorm if i + 1 < len(self.layers) else self.final_norm
            q, new_kv = self._attention_inputs(layer, x, T, cos, sin, step, sums, segments)
            parts = [seg.attend(layer, q, pos, step, ops, new_kv) for seg in segments]
            a = parts[0] if len(parts) == 1 else torch.cat(parts)
            h, x = residual_norm_rms(h, out_of(layer.o, a), _w(hf.post_attention_layernorm),
                                     _eps(hf.post_attention_layernorm), None, _w(hf.pre_feedforward_layernorm),
                                     _eps(hf.pre_feedforward_layernorm))
            # On the step kernels the gelus run in the epilogues of the matmuls they read (one launch
            # less each, FUSED_GELU): the same arithmetic on the same bits (tests/test_step_kernel_rows.py).
            if step and layer.gate_up_gelu is not None:
                activated = layer.gate_up_gelu(x)
            elif step and self.fused_gelu and layer.gate_up is None:
                activated = layer.gate(x, gelu_times=layer.up(x))
            else:
                if layer.gate_up is not None:
                    g, u = layer.gate_up(x).split((layer.gate.out_features, layer.up.out_features), -1)
                else:
                    g, u = layer.gate(x), layer.up(x)
                activated = ops.gelu_mul(g, u)
            y = out_of(layer.down, activated)
            post_ff = (_w(hf.post_feedforward_layernorm), _eps(hf.post_feedforward_layernorm))
            last_norm = (getattr(hf, "layer_scalar", None), _w(next_norm), _eps(next_norm))
            if self.ple_dim:
                h = residual_norm(h, y, *post_ff, None)
                ple_in = ple[:, layer.index]
                # (the gate sums its own slices: its gelu, fused or not, reads them summed and rounded, so
                # steps of every size get the same bits; a summed op would be another kernel's arithmetic)
                if step and self.fused_gelu and T <= PLE_GELU_FUSED_ROWS:
                    gated = layer.ple_gate(h, gelu_times=ple_in)
                else:
                    gated = ops.gelu_mul(layer.ple_gate(h), ple_in)
                y = out_of(layer.ple_proj, gated)
                post_ff = (_w(hf.post_per_layer_input_norm), _eps(hf.post_per_layer_input_norm))
            h, x = residual_norm_rms(h, y, *post_ff, *last_norm)
        if step and self.lm_head_capped is not None:  # the soft-capping in the LM head's store
            return self.lm_head_capped(x)
        logits = (self.lm_head_step if step else self.lm_head)(x)  # x: the final norm of h
        return ops.softcap(logits, self.softcap) if self.softcap else logits

    def _attention_inputs(self, layer: _Layer, x: torch.Tensor, T: int, cos, sin, step: bool, sums: bool,
                          segments: list["Segment"]) -> tuple:
        """A layer's queries, normed and rotated, and its new keys and values: (q, new_kv). A
        KV-owning layer's k and v are normed (k rotated) in q's kernel; on the step kernels they are
        new_kv, for the step attention's launch to write (server/step_attention.py), else written
        to the segments' caches here and new_kv is None (as for a layer reading another's cache).
        `sums`: q|k|v's K slices summed by that kernel (`slices`; separate k and v linears cannot:
        they share one partials scratch)."""
        ops, attn, D = self.ops, layer.hf.self_attn, layer.head_dim
        owns_kv = layer.source == layer.index
        if sums and (layer.qkv is not None or not owns_kv):
            summed = self.summed_qkv_ops
            # the partials [S, T, N] of q|k|v (or q alone), as [S, T, heads, D] each
            pq, *pkv = (layer.qkv.slices(x).split(layer.qkv_sizes, -1) if layer.qkv is not None
                        else [layer.q.slices(x)])
            pq = pq.unflatten(-1, (self.num_heads, D))
            if not owns_kv:
                return summed.summed_norm_rope(pq, self.dtype, _w(attn.q_norm), _eps(attn.q_norm), cos, sin), None
            pk, pv = (p.unflatten(-1, (layer.kv_heads, D)) for p in (pkv if len(pkv) == 2 else pkv * 2))
            q, k, v = summed.summed_qkv_norm_rope(pq, pk, pv, self.dtype, _w(attn.q_norm), _eps(attn.q_norm),
                                               _w(attn.k_norm), _eps(attn.k_norm), _w(attn.v_norm), _eps(attn.v_norm),
                                               cos, sin)
            return q, (k, v)
        if layer.qkv is not None:
            q_raw, k_raw, *v_raw = layer.qkv(x).split(layer.qkv_sizes, -1)
            k_raw = k_raw.view(T, layer.kv_heads, D)
            v_raw = v_raw[0].view(T, layer.kv_heads, D) if v_raw else k_raw
        else:
            q_raw = layer.q(x)
            if owns_kv:
                k_raw = layer.k(x).view(T, layer.kv_heads, D)
                v_raw = layer.v(x).view(T, layer.kv_heads, D) if layer.v is not None else k_raw
        q_raw = q_raw.view(T, self.num_heads, D)
        if not owns_kv:
            return ops.norm_rope(q_raw, _w(attn.q_norm), _eps(attn.q_norm), cos, sin), None
        q, k, v = ops.qkv_norm_rope(q_raw, k_raw, v_raw, _w(attn.q_norm), _eps(attn.q_norm), _w(attn.k_norm),
                                    _eps(attn.k_norm), _w(attn.v_norm), _eps(attn.v_norm), cos, sin)
        if step:  # the step attention's launch writes them (server/step_attention.py new_kv)
            return q, (k, v)
        for seg in segments:
            seg.write_kv(layer, k, v)
        return q, None

    # ------------------------------------------------------------ steps

    def _kv_len(self, end: int) -> int:
        return min(self.max_len, max(self.min_kv_len, _pow2_at_least(end)))

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} tokens exceed the largest step bucket {self.max_bucket}")

    @property
    def position(self) -> int:
        return self.pos

    def reset(self) -> None:
        """Forget everything: positions restart at 0, no kept live sequence."""
        self.pos = 0
        self.prefix.reset()

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.pos:
            raise ValueError(f"cannot roll back {n} of {self.pos} positions")
        self.pos -= n
        self._last_step = None

    @torch.no_grad()
    def start(self, prompt_ids: list[int], reuse: bool = True) -> Prefill:
        """Begin a sequence (server/backend.py): reuse the longest kept prefix, prefill the rest
        layer by layer (server/fast_prefill.py) in pieces of `prefill_rows` tokens (each piece
        resumes from the cache the one before wrote, as a prefix-cache restore does), return the
        last prompt token's logits. A rest of at most `prefill_by_steps` tokens runs as steps of
        the largest bucket instead (`_prefill_by_steps`)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        self._check_room(len(prompt_ids))
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        begin = self.prefix.begin(prompt, reuse)
        self.pos, self._keep = begin, reuse
        self._last_step = None
        t0 = time.perf_counter()
        try:
            # (padding rows of the last step must fit the cache too)
            if len(prompt_ids) - begin <= self.prefill_by_steps and len(prompt_ids) + self.max_bucket <= self.max_len:
                logits = self._prefill_by_steps(prompt_ids, begin)
            else:
                for at in range(begin, len(prompt_ids), self.prefill_rows):
                    piece = prompt_ids[at:at + self.prefill_rows]
                    with self.batch.lock if self.batch is not None else nullcontext():  # the other lanes' steps run between pieces
                        logits = prefill_layers(self, piece, at, self.prefix.add_checkpoint)
        except BaseException:
            self._leave()  # a lane that joined for its prompt steps: the others stop waiting for it
            raise
        self._join()
        self.prefix.note_written(begin, prompt[begin:], len(prompt) - begin)
        self.pos = len(prompt_ids)
        self.timings.prefill_s += time.perf_counter() - t0
        return Prefill(logits, begin)

    def _prefill_by_steps(self, prompt_ids: list[int], begin: int) -> torch.Tensor:
        """Positions begin.. of the prompt written by steps of up to `max_bucket` tokens (a lane's:
        `batch.rows_budget` tokens, in the lanes' shared forwards); the last token's logits. Its K/V come from the
        step kernels, as generated tokens' do, so a prefix cached this way rounds as a decoded one
        (tests/test_prefix_cache.py's CUDA test measures cached against fresh). No sliding-window
        checkpoints are made: a later resume inside this stretch uses an earlier one (exact)."""
        logits = None
        # A lane's prompt steps join the lanes' forwards like any step (stacked with the others'
        # steps and prompt steps: the same bits as alone), rather than queueing between them.
        self._join()
        # lanes: steps no wider than a shared forward's budget, so the others' steps are not padded past it
        width = self.max_bucket if self.batch is None else self.batch.rows_budget
        for at in range(begin, len(prompt_ids), width):
            logits = self.step(prompt_ids[at:at + width])[-1].clone()
        self._last_step = None  # not a step keep_path may follow
        return logits

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """The last token's logits of `prompt_ids` computed from position 0 (nothing reused or kept)."""
        return self.start(prompt_ids, reuse=False).logits

    def finish(self, tokens, generated: int) -> None:
        try:
            if len(tokens) != self.pos:
                raise AssertionError(f"finish with {len(tokens)} tokens, but the cache holds {self.pos}")
            self.prefix.finish(self.pos, generated, self._keep)
        finally:
            self._leave()

    def discard(self) -> None:
        self.prefix.discard()
        self._leave()

    def held_prefix(self, prompt_ids: list[int]) -> int:
        """How many of the prompt's first tokens the live cache holds for it to resume in place
        (server/lane_pool.py; FastPrefixCache.live_match says when it counts)."""
        return self.prefix.live_match(prompt_ids)

    @property
    def batcher(self):
        """The StepBatcher of the lanes this target is one of (its counters: /metrics), else None."""
        return self.batch.batcher if self.batch is not None else None

    def shared_load(self) -> tuple[int, int]:
        """(requests, rows) that shared this lane's last forward besides it ((0, 0) when alone):
        server/cost_model.py weighs a draft against them."""
        return self._others if self._joined else (0, 0)

    def shared_room(self, others: tuple[int, int]) -> int:
        """The most drafted tokens a step of this lane should carry when it shares forwards: the
        lanes in a request now (the batcher's members; at least those of the last forward,
        `others` = (lanes, rows) besides this one) each get an equal share of `batch.rows_for(lanes)`
        rows, and the step's bucket (stacked steps are padded to the widest one's) stays within
        it; at least one drafted token. Alone: the largest bucket's."""
        if self.batch is None:
            return self.max_bucket - 1
        lanes = max(others[0] + 1, self.batch.batcher.members)
        if lanes <= 1:
            return self.max_bucket - 1
        share = self.batch.rows_for(lanes) // lanes
        fitting = [b for b in self.buckets if b <= share]
        return max(1, (fitting[-1] if fitting else 1) - 1)

    def _join(self) -> None:
        """A lane in a request: from now on the other lanes' steps wait (a while) for its own."""
        if self.batch is not None and not self._joined:
            self.batch.join()
            self._joined = True

    def _leave(self) -> None:
        self._others = (0, 0)
        if self._joined:
            self._joined = False
            self.batch.leave()

    def prefix_summary(self) -> dict | None:
        return self.prefix.summary()

    @property
    def store(self):
        """The prefix cache's kept snapshots (None when it is off)."""
        return self.prefix.store

    supports_tree = True  # step(ids, parents) and keep_path (server/backend.py)

    @torch.no_grad()
    def step(self, ids: list[int], parents: list[int] | None = None) -> torch.Tensor:
        """Append 1..max_bucket tokens at the current position; their logits [n, vocab]. With
        `parents`, the rows are a token tree (see the module docstring and server/backend.py); a
        row's logits equal those of the chain of its root path, bit for bit on the step kernels.
        A lane (server/fast_batch.py) hands its step to the lanes' batcher, which may run it in one
        forward with the other lanes' steps: the same logits, bit for bit on the step kernels."""
        if self.batch is not None:
            return self.batch.step(self, ids, parents)
        return self.step_alone(ids, parents)

    @torch.no_grad()
    def step_alone(self, ids: list[int], parents: list[int] | None = None) -> torch.Tensor:
        """`step` in a forward of this target's rows only (its captured graphs on CUDA)."""
        n, T, kv_len = self._stage_step(ids, parents)
        if self.capture:
            graph, out = self._graph(T, kv_len)
            graph.replay()
            logits = out
        else:
            logits = self._forward(self.ids_buf[:T], self.pos_buf[:T], kv_len, step=True)
        self._after_step(ids, parents, T)
        return logits[:n]

    @property
    def chains_steps(self) -> bool:
        """Whether `step_after_argmax` chains steps on the device here (what the engine asks)."""
        return self._chains_on_device()

    def _chains_on_device(self) -> bool:
        """A lone target's captured graphs whose tables the GPU reads in place (a staged table's rows
        need the token on the host)."""
        return CHAINED_STEPS and self.async_steps and not self.ple_staged and not self.embed_staged

    @torch.no_grad()
    def step_after_argmax(self, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Plain greedy decoding without a round trip: `logits` [1, vocab] (or [vocab]) are the last
        step's (or the prefill's) logits of the pending token; the token they choose (the argmax,
        `row_argmax`'s) is read back and returned with the logits [1, vocab] of a one-token step of
        it, launched before the host waited for it. The step's input is that argmax on the device,
        so the GPU runs the next step while the host reads the token, hands out its text and stages
        the step after: as `token = row_argmax(logits)[0]; next = step([token])`, the same token and
        logits, without the GPU idling for the host between steps (where `chains_steps`; elsewhere
        that plain sequence). If the caller stops at the returned token, the step launched after it
        is rolled back like any other (`rollback(1)`: the token is pending again)."""
        if not self._chains_on_device():
            token = row_argmax(logits)[0]
            return token, self.step([token])
        chosen = logits.reshape(-1, logits.shape[-1])[0].argmax().reshape(1)   # on the device, queued after the step
        slot = self._chain_slot = (self._chain_slot + 1) % 2
        self._chain_token[slot].copy_(chosen, non_blocking=True)
        read = self._chain_read[slot]
        read.record()
        T = self._bucket(1)
        _, kv_len = self._stage_host([0], None, T)
        # The host rows into a pinned buffer of this slot (two: the one copied two chained steps ago
        # has been read, since the host waited for a later token), copied without blocking; then the
        # token on the device over row 0's placeholder id.
        host = self._chain_host[slot]
        host.copy_(self._host_in)
        self._in_buf.copy_(host, non_blocking=True)
        self.ids_buf[:1].copy_(chosen)
        graph, out = self._graph(T, kv_len)
        graph.replay()
        read.synchronize()  # the token's copy only: the step just launched may still be running
        token = int(self._chain_token[slot][0])
        self._after_step([token], None, T)
        return token, out[:1]

    def _stage_step(self, ids: list[int], parents: list[int] | None) -> tuple[int, int, int]:
        """A step's inputs into the static buffers (ids_buf, pos_buf, anc_buf, path_buf, ple_buf):
        (tokens, bucket, kv_len). The cache is not touched."""
        T = self._bucket(len(ids))
        n, kv_len = self._stage_host(ids, parents, T)
        host = self._host_in
        # One copy of all three rows (past T they hold an earlier step's values, which no graph of
        # bucket T reads); blocking, so the host rows are free for the next step when it returns.
        self._in_buf.copy_(host)
        if self.ple_staged:  # the per-layer rows, gathered on the host (the graph reads ple_buf)
            self.embed_ple.rows_into(host[0, :T], self.ple_buf[:T])
        if self.embed_staged:
            self.embed.rows_into(host[0, :T], self.embed_buf[:T])
        return n, T, kv_len

    def _stage_host(self, ids: list[int], parents: list[int] | None, T: int) -> tuple[int, int]:
        """A step of T rows (its bucket or larger): ids, positions and ancestor bits into the host
        rows `_host_in`, a tree's paths into path_buf; (tokens, kv_len)."""
        n = len(ids)
        if n > T:
            raise ValueError(f"{n} tokens in a step of {T} rows")
        self._check_room(self.pos + T)
        kv_len = self._kv_len(self.pos + T)
        host = self._host_np
        host[0, :n] = ids
        host[0, n:T] = 0
        if parents is None:
            np.add(self._rows_np[:T], self.pos, out=host[1, :T])
            host[2, :T] = self._chain_anc_np[:T]
            if not self._path_is_chain:
                self.path_buf.copy_(self._chain_path)
                self._path_is_chain = True
        else:
            depth, anc = tree_rows(parents, n, T)
            host[1, :T] = depth + self.pos
            host[2, :T] = anc
            self._host_path[:T, :T] = torch.from_numpy(tree_paths(parents, n, T))
            self.path_buf[:T].copy_(self._host_path[:T])
            self._path_is_chain = False
        return n, kv_len

    def _after_step(self, ids: list[int], parents: list[int] | None, T: int) -> None:
        """What a step that wrote a bucket of T rows leaves: the prefix cache's record, keep_path's, the position."""
        self.prefix.note_written(self.pos, ids, T)
        self._last_step = (self.pos, list(ids), T, None if parents is None else list(parents))
        self.pos += len(ids)

    @torch.no_grad()
    def keep_path(self, path: list[int]) -> None:
        """Right after a step that began at position s: keep the rows `path` = [0, r1, .., rk]
        (strictly increasing, each the parent of the next). Row r_i's K/V move to position s + i in
        every layer that owns a cache (the ring slot of s + i on sliding layers); position becomes
        s + len(path). Afterwards the cache is what a chain step of those tokens followed by a
        rollback leaves: slot_pos already holds s + j at ring slot (s + j) % ring for every row j the
        step wrote (the tree step records write positions), and masks hide positions past the end."""
        if self._last_step is None:
            raise ValueError("keep_path must follow a step")
        start, ids, T, parents = self._last_step
        n = len(ids)
        parents = list(range(-1, n - 1)) if parents is None else parents
        if not path or path[0] != 0 or any(parents[b] != a for a, b in zip(path, path[1:])):
            raise ValueError(f"{path} is not a root path of the last step's rows")
        k = len(path)
        if path != list(range(k)):
            src = torch.tensor(path, device=self.device) + start
            dst = torch.arange(start, start + k, device=self.device)
            for index, kc in self.k_cache.items():
                vc = self.v_cache[index]
                s_, d_ = (src % self.ring, dst % self.ring) if self.layers[index].sliding else (src, dst)
                kc.index_copy_(1, d_, kc.index_select(1, s_))
                vc.index_copy_(1, d_, vc.index_select(1, s_))
        self.prefix.note_written(start, [ids[j] for j in path], T)
        self.pos = start + k
        self._last_step = None

    def _check_room(self, end: int) -> None:
        if end > self.max_len:
            raise ValueError(f"position {end} exceeds the fast path's cache of {self.max_len}")

    # ------------------------------------------------------------ CUDA graphs

    def _graph(self, T: int, kv_len: int):
        key = (T, kv_len)
        if key not in self._graphs:
            t0 = time.perf_counter()
            ids, pos = self.ids_buf[:T], self.pos_buf[:T]
            self._graphs[key] = capture_graph(lambda: self._forward(ids, pos, kv_len, step=True), self, T)
            seconds = time.perf_counter() - t0
            self.timings.extra.setdefault("capture_s", {})[key] = seconds  # per (bucket, kv_len), for reports
            self.timings.capture_s += seconds
            self.timings.graphs += 1
        return self._graphs[key]

    @torch.no_grad()
    def warmup(self, kv_lens: tuple[int, ...] | None = None) -> float:
        """Capture every (bucket, kv_len) graph up front; returns the seconds it took.
        Positions are saved and restored; slots written here hold positions past the committed
        one, which masks hide."""
        if not self.capture:
            return 0.0
        t0 = time.perf_counter()
        self.prefix.discard()  # the warm-up writes K/V at arbitrary positions: no live sequence survives it
        saved_pos, saved_slots = self.pos, self.slot_pos.clone()
        if kv_lens is None:
            kv_lens, n = [], self.min_kv_len
            while True:
                kv_lens.append(min(n, self.max_len))
                if n >= self.max_len:
                    break
                n *= 2
        for kv_len in kv_lens:
            for T in self.buckets:
                start = max(0, min(kv_len, self.max_len) - T)
                self.pos_buf[:T].copy_(torch.arange(start, start + T, device=self.device))
                self.ids_buf[:T].zero_()
                self.anc_buf.copy_(self._chain_anc)  # a chain: the graphs are captured on chain inputs
                self.path_buf.copy_(self._chain_path)
                self._path_is_chain = True
                self._graph(T, kv_len)
        self.pos = saved_pos
        self.slot_pos.copy_(saved_slots)
        return time.perf_counter() - t0


    def warm_prefill(self) -> float:
        """One prefill of a whole piece and a shorter one (token 0), then forgotten: the prefill's
        kernels (cuBLAS's, loaded lazily) join the CUDA context now rather than at the first request,
        so the engine measures the context grown (server/fast_memory.settle_after_warmup) and no
        request pays the loading. Returns the seconds it took."""
        t0, counted = time.perf_counter(), self.timings.prefill_s
        n = min(self.prefill_rows + 17, self.max_context - 1)
        self.prefill([0] * n)
        self.discard()
        self.reset()
        self.timings.prefill_s = counted  # not a request's prefill
        return time.perf_counter() - t0


def capture_graph(forward, target: FastTarget, out_key=None, out_rows: int | None = None) -> tuple:
    """(CUDA graph, logits buffer) of `forward()` (a step's forward over static buffers), in
    `target`'s graph pool. Warmed up first on a side stream (allocator and library handles): the
    warm-up writes K/V at the current positions, which the replay rewrites identically. The logits
    are copied into the first rows of a buffer kept per `out_key` (of `out_rows` rows or the
    logits'; a lone lane's bucket: shared by its graphs of every kv_len, as a step's logits are
    read before the next step; E4B at 32k: 7 kv_lens x 63 MiB of logits otherwise) or, for None,
    one of its own; the graphs' own outputs go back to the pool.
    Capture errors only on this thread's unsafe calls: another lane's thread may copy logits to
    the host meanwhile (server/batch_step.py captures while serving)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if target._pool is None:
        target._pool = torch.cuda.graph_pool_handle()
    out = target._graph_out.get(out_key) if out_key is not None else None
    with torch.cuda.graph(graph, pool=target._pool, capture_error_mode="thread_local"):
        logits = forward()
        rows = logits.shape[0]
        if out is None or out.shape[0] < rows or out.shape[1:] != logits.shape[1:] or out.dtype != logits.dtype:
            out = logits.new_empty((max(rows, out_rows or 0), *logits.shape[1:]))
            if out_key is not None:
                target._graph_out[out_key] = out
        out[:rows].copy_(logits)
    del logits
    torch.cuda.synchronize()
    return graph, out[:rows]


class Segment:
    """Rows lo..hi-1 of a forward: one sequence's, `target`'s (its cache, ring positions, tree
    buffers), at `kv_len`. The forward's per-sequence work: where its rows write, their masks off
    the step kernels, their K/V writes and their attention."""

    def __init__(self, target: "FastTarget", lo: int, hi: int, kv_len: int):
        self.target, self.lo, self.hi, self.kv_len = target, lo, hi, kv_len

    def prepare(self, pos: torch.Tensor, from_buffers: bool, step: bool, ops) -> None:
        t, n = self.target, self.hi - self.lo
        rows = pos[self.lo:self.hi]
        # Where each row writes: rows[0] + row for a step (equal to rows for a chain), rows otherwise.
        self.wpos = rows[:1] + t.row_index[:n] if from_buffers else rows
        # Sliding layers: record which position each written ring slot now holds (the write position,
        # as a chain would: a tree's slot_pos is then what a chain step and a rollback leave).
        self.slots = self.wpos % t.ring
        t.slot_pos.index_copy_(0, self.slots, self.wpos)
        if not step:  # the step kernels mask by position themselves
            if from_buffers:
                self.masks = ops.step_masks(t.slot_pos, t.full_pos[:self.kv_len], rows, t.anc_buf[:n], t.window)
            else:
                self.masks = ops.masks(t.slot_pos, t.full_pos[:self.kv_len], rows, t.window)

    def write_kv(self, layer: _Layer, k: torch.Tensor, v: torch.Tensor) -> None:
        """The rows' K/V into the cache, off the step kernels (on them the step attention writes them)."""
        where = self.slots if layer.sliding else self.wpos
        self.target.k_cache[layer.index].index_copy_(1, where, k[self.lo:self.hi].transpose(0, 1))
        self.target.v_cache[layer.index].index_copy_(1, where, v[self.lo:self.hi].transpose(0, 1))

    def attend(self, layer: _Layer, q: torch.Tensor, pos: torch.Tensor, step: bool, ops,
               new_kv: tuple | None = None) -> torch.Tensor:
        """The rows' attention; `new_kv` (a step's, on the step kernels): the layer's new K/V rows, not
        yet in the cache, which the step attention's launch writes (write_kv is not called then)."""
        t, attn = self.target, layer.hf.self_attn
        kc, vc = t.k_cache[layer.source], t.v_cache[layer.source]
        q = q[self.lo:self.hi]
        if new_kv is not None:
            new_kv = tuple(x[self.lo:self.hi] for x in new_kv)
        if step:
            return t.step_attention[layer.head_dim](q, kc, vc, self.kv_len, pos[self.lo:self.hi],
                                                    t.slot_pos if layer.sliding else None, t.window, attn.scaling,
                                                    t.path_buf, new_kv=new_kv)
        assert new_kv is None, "new K/V rows are written by the step attention only"
        sliding_mask, full_mask = self.masks
        if layer.sliding:
            mask = sliding_mask
        else:
            kc, vc, mask = kc[:, :self.kv_len], vc[:, :self.kv_len], full_mask
        return _attention(q, kc, vc, mask, attn.scaling, ops.masked_softmax)


def tree_rows(parents: list[int], n: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """Depth [T] and ancestor masks [T] (int64; bit j of anc[t]: row j is t or an ancestor of t) of
    a token tree of n rows given by `parents` (parents[0] == -1, 0 <= parents[j] < j), padded to T
    rows that continue a chain from the last row (their outputs are discarded)."""
    if len(parents) != n:
        raise ValueError(f"{len(parents)} parents for a tree of {n} rows")
    return tree_layout(list(parents) + list(range(n - 1, T - 1)))


def tree_paths(parents: list[int], n: int, T: int) -> np.ndarray:
    """[T, T] int64: row [t, j] is the row of t's ancestor at depth j (t itself at its depth; 0
    past it), for the tree of `tree_rows` (padding rows continue a chain from the last row)."""
    out = np.zeros((T, T), dtype=np.int64)
    depth = [0] * T
    for j in range(1, T):
        p = parents[j] if j < n else j - 1
        depth[j] = depth[p] + 1
        out[j, :depth[j]] = out[p, :depth[j]]
        out[j, depth[j]] = j
    return out
