"""Server options, each defined once: the `Settings` dataclass below also generates the CLI.

Contract: `Settings.from_args(argv)` parses `python -m server ...`; every `Settings` field becomes
`--field-name` (help text and type from the field), booleans become `--x/--no-x`. The drafting
knobs are not repeated here: every field of `ngram.drafter.DrafterConfig` becomes a flag of the
same name (`--max-draft`, `--min-match`, `--confidence-cutoff`, ...) and lands in
`Settings.drafter`. The API key may also come from the environment variable `SAILFISH_API_KEY`.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from ngram.drafter import DrafterConfig

API_KEY_ENV = "SAILFISH_API_KEY"
DEFAULT_PORT = 22343


@dataclass
class Settings:
    host: str = field(default="127.0.0.1", metadata={"help": "interface to bind"})
    port: int = field(default=DEFAULT_PORT, metadata={"help": "TCP port"})
    model: str | None = field(default=None, metadata={
        "help": "model directory, .gguf file or cached Hugging Face id (default: the bundled Gemma 3 270M)"})
    quant: str | None = field(default=None, metadata={"help": "weights: int4, int8 or none (default: per model)"})
    dtype: str | None = field(default=None, metadata={"help": "fp32, bf16 or fp16 (default: per device)"})
    device: str | None = field(default=None, metadata={"help": "cpu or cuda (default: cuda when available)"})
    index: Path | None = field(default=None, metadata={
        "help": "n-gram index directory (default: the one `make index` builds)"})
    draft: bool = field(default=True, metadata={"help": "draft and verify (--no-draft: plain greedy decoding)"})
    api_key: str | None = field(default=None, metadata={
        "help": f"require `Authorization: Bearer KEY` on /v1/* (also from ${API_KEY_ENV})"})
    trace_log: bool = field(default=True, metadata={
        "help": "append each completed chat request to the trace log (--no-trace-log: off)"})
    trace_dir: Path | None = field(default=None, metadata={
        "help": "trace log directory (default: common.paths.default_trace_dir())"})
    trace_rotate_mb: int = field(default=64, metadata={"help": "start a new trace file past this size"})
    default_max_tokens: int = field(default=2048, metadata={
        "help": "completion limit when a chat request sets no max_tokens"})
    max_context: int | None = field(default=None, metadata={
        "help": "context limit in tokens (default: the model's max_position_embeddings)"})
    adaptive: bool = field(default=True, metadata={
        "help": "decide per step whether a draft pays, from the measured verify cost curve"})
    prefix_cache: bool = field(default=True, metadata={
        "help": "keep finished sequences' KV and prefill only what a new prompt adds "
                "(--no-prefix-cache: every prompt from position 0)"})
    prefix_cache_mb: int | None = field(default=None, metadata={
        "help": "memory for kept sequences in MiB (default: 20%% of free memory, at most 8 GiB on the CPU; "
                "on the GPU fast path 40%% of what its static cache leaves)"})
    fast_max_context: int | None = field(default=None, metadata={
        "help": "cap on the GPU fast path's static cache in tokens (default: the model's context, "
                "or what GPU memory allows)"})
    remeasure_cost: bool = field(default=False, metadata={
        "help": "measure the verify cost curve again even if one was kept for this model, device and path"})
    fast_path: bool = field(default=True, metadata={
        "help": "on CUDA, Gemma 4: static KV cache and CUDA graphs (--no-fast-path: transformers eager)"})
    watch_index: float = field(default=5.0, metadata={
        "help": "seconds between checks for a rebuilt index (0: only on SIGHUP or POST /admin/reload-index)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    drafter: DrafterConfig = field(default_factory=DrafterConfig, metadata={"cli": False})

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="python -m server",
                                    description="Sailfish: an OpenAI-compatible server with n-gram drafting.")
        for f in fields(cls):
            if f.metadata.get("cli", True):
                _add_flag(p, f.name, f.type, f.default, f.metadata.get("help", ""))
        g = p.add_argument_group("drafting knobs (ngram.drafter.DrafterConfig)")
        for f in fields(DrafterConfig):
            _add_flag(g, f.name, f.type, f.default, f.metadata.get("help", f.name), dest=f"drafter.{f.name}")
        return p

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "Settings":
        ns = vars(cls.parser().parse_args(argv))
        knobs = {k.split(".", 1)[1]: v for k, v in ns.items() if k.startswith("drafter.")}
        own = {k: v for k, v in ns.items() if not k.startswith("drafter.")}
        settings = cls(**own, drafter=replace(DrafterConfig(), **knobs))
        if settings.api_key is None:
            settings.api_key = os.environ.get(API_KEY_ENV) or None
        return settings


def _add_flag(p, name: str, typ, default, help_text: str, dest: str | None = None) -> None:
    flag = "--" + name.replace("_", "-")
    dest = dest or name
    typ = str(typ)
    default = None if default is MISSING else default
    if typ.startswith("bool"):
        p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        return
    conv = int if typ.startswith("int") else float if typ.startswith("float") else Path if "Path" in typ else str
    shown = f" (default {default})" if default is not None else ""
    p.add_argument(flag, dest=dest, type=conv, default=default, metavar=name.upper(), help=help_text + shown)
