"""The engine's options, each defined once: `EngineConfig`'s fields also generate the server's flags.

Contract: every field whose metadata does not say `cli: False` becomes `python -m server --field-name`
(help text from the field; see server.settings), so a knob is named, typed, defaulted and explained
here only. The draft cap defaults to the drafter's (`DrafterConfig.max_draft`) and is lowered by the
engine to what its backend's largest step takes. Light on purpose (no torch): `--help` imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ngram.drafter import DrafterConfig


@dataclass
class EngineConfig:
    max_draft: int = field(default=DrafterConfig.max_draft, metadata={"cli": False})  # the drafter's --max-draft
    adaptive: bool = field(default=True, metadata={
        "help": "decide per step whether a draft pays, from the measured verify cost curve "
                "(--no-adaptive: verify every draft in full)"})
    max_context: int | None = field(default=None, metadata={
        "help": "context limit in tokens (default: the model's max_position_embeddings)"})
    fast_path: bool = field(default=True, metadata={
        "help": "on CUDA, Gemma 4: static KV cache and CUDA graphs (--no-fast-path: transformers eager)"})
    cpu_int8: bool = field(default=True, metadata={
        "help": "on the CPU, Gemma 3 and Gemma 4 text models: int8 weights, a static KV cache and batch-invariant C kernels "
                "(server/cpu_model.py; --no-cpu-int8: transformers' fp32 forward)"})
    fast_max_context: int | None = field(default=None, metadata={
        "min": 1, "help": "cap on the GPU fast path's static cache in tokens (default: the model's context, "
                "or what GPU memory allows)"})
    gpu_memory_mb: float | None = field(default=None, metadata={
        "min": 1, "help": "cap on the GPU memory the fast path plans for, in MiB, the loaded weights included (default: "
                "the card's free memory): the context, the prefix cache and prefill's working memory are sized "
                "to fit it, with the CUDA context and libraries (measured as the card's used memory less "
                "PyTorch's: other processes on the card count too)"})
    lm_head: str = field(default="auto", metadata={
        "choices": ("auto", "bf16", "int8"), "help": "the GPU fast path's LM head: int8 (a scale per 128 features; "
                "frees 0.6 GiB on E4B, the input embedding looked up on the host) or bf16; auto: int8 under "
                "--gpu-memory-mb where the step kernels run it (Triton, bf16, a head that tiles), else bf16"})
    prefix_cache: bool = field(default=True, metadata={
        "help": "keep finished sequences' KV and prefill only what a new prompt adds "
                "(--no-prefix-cache: every prompt from position 0)"})
    prefix_cache_mb: float | None = field(default=None, metadata={
        "min": 0,
        "help": "memory for kept sequences in MiB (default: 20%% of free memory, at most 8 GiB on the CPU; "
                "on the GPU fast path 40%% of what its static cache leaves)"})
    parallel: int | None = field(default=None, metadata={
        "min": 1, "help": "requests decoded at once, their steps sharing forwards (the CPU int8 path and the GPU "
                "fast path batch them, the GPU with a cache per request; each output stays the one it gets "
                "alone); more wait in arrival order (default: 4 on the CPU int8 path, else 1)"})
    remeasure_cost: bool = field(default=False, metadata={
        "help": "measure the verify cost curve again even if one was kept for this model, device and path"})
    # not flags: set by code (tests, benchmarks, the server's loader)
    cost_curve: np.ndarray | None = field(default=None, metadata={"cli": False})  # cost[n]; None: measured
    cost_context: int = field(default=256, metadata={"cli": False})  # cache length the curve is measured at
    cost_cache: Path | None = field(default=None, metadata={"cli": False})  # where curves are kept (None: none)
    # each step launched before the text before it is handed out: None where the backend's steps run
    # asynchronously (`async_steps`: the GPU fast path's graphs); True / False force it (tests)
    launch_early: bool | None = field(default=None, metadata={"cli": False})

    @property
    def gpu_memory_bytes(self) -> int | None:
        """The GPU memory cap in bytes (None: the card's free memory)."""
        return None if self.gpu_memory_mb is None else int(self.gpu_memory_mb * 2**20)

    @property
    def prefix_cache_bytes(self) -> int | None:
        """The kept-sequence budget in bytes (None: sized from free memory)."""
        return None if self.prefix_cache_mb is None else int(self.prefix_cache_mb * 2**20)
