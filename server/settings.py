"""Server options, each defined once: the `Settings` dataclass below also generates the CLI.

Contract: `Settings.from_args(argv)` parses `python -m server ...`; every `Settings` field becomes
`--field-name` (help text and type from the field), booleans become `--x/--no-x`. The engine's
and the drafter's options are not repeated here: every field of `server.engine_config.EngineConfig`
(`--max-context`, `--prefix-cache-mb`, `--fast-path`, ...) and of `ngram.drafter.DrafterConfig`
(`--max-draft`, `--min-match`, `--confidence-cutoff`, ...) becomes a flag of the same name and
lands in `Settings.engine` / `Settings.drafter`. The API key may also come from the environment variable `SAILFISH_API_KEY`.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from common.config_flags import add_flags, config_from
from ngram.drafter import DrafterConfig
from server.engine_config import EngineConfig

API_KEY_ENV = "SAILFISH_API_KEY"
DEFAULT_PORT = 22343


@dataclass
class Settings:
    host: str = field(default="127.0.0.1", metadata={"help": "interface to bind"})
    port: int = field(default=DEFAULT_PORT, metadata={"min": 0, "max": 65535, "help": "TCP port (0: any free one)"})
    model: str | None = field(default=None, metadata={
        "help": "model directory, .gguf file or cached Hugging Face id (default: the bundled Gemma 3 270M)"})
    quant: str | None = field(default=None, metadata={"help": "weights: int4, int8 or none (default: per model)"})
    dtype: str | None = field(default=None, metadata={"help": "fp32, bf16 or fp16 (default: per device)"})
    device: str | None = field(default=None, metadata={"help": "cpu or cuda (default: cuda when available)"})
    index: Path | None = field(default=None, metadata={
        "help": "n-gram index directory (default: the one `make index` builds)"})
    draft: bool = field(default=True, metadata={"help": "draft and verify (--no-draft: plain greedy decoding)"})
    api_key: str | None = field(default=None, metadata={
        "help": "require `Authorization: Bearer KEY` (or, on /v1/messages, `x-api-key: KEY`) on /v1/* and "
                f"/admin/* (also from ${API_KEY_ENV})"})
    cors_origins: str | None = field(default=None, metadata={
        "help": "browser origins allowed to call the API (CORS): comma-separated, or * for any "
                "(default: none, no CORS headers)"})
    trace_log: bool = field(default=True, metadata={
        "help": "append each completed chat request to the trace log (--no-trace-log: off)"})
    trace_dir: Path | None = field(default=None, metadata={
        "help": "trace log directory (default: common.paths.default_trace_dir())"})
    trace_rotate_mb: int = field(default=64, metadata={"help": "start a new trace file past this size"})
    default_max_tokens: int = field(default=2048, metadata={
        "help": "completion limit when a chat request sets no max_tokens"})
    generation_defaults: bool = field(default=True, metadata={
        "help": "take defaults for the sampling fields a request omits from the checkpoint's generation_config, "
                "as vLLM does (--no-generation-defaults: greedy unless a request asks to sample)"})
    watch_index: float = field(default=5.0, metadata={
        "help": "seconds between checks for a rebuilt index (0: only on SIGHUP or POST /admin/reload-index)"})
    max_waiting: int = field(default=64, metadata={
        "help": "requests that may wait while --parallel run (0: none wait); past it the server answers 429 with "
                "Retry-After"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    drafter: DrafterConfig = field(default_factory=DrafterConfig, metadata={"cli": False})
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"cli": False})

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="python -m server",
                                    description="Sailfish: an OpenAI-compatible server with n-gram drafting.")
        add_flags(p, cls)
        add_flags(p.add_argument_group("engine (server.engine_config.EngineConfig)"), EngineConfig, "engine")
        add_flags(p.add_argument_group("drafting knobs (ngram.drafter.DrafterConfig)"), DrafterConfig, "drafter")
        return p

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "Settings":
        ns = vars(cls.parser().parse_args(argv))
        own = {k: v for k, v in ns.items() if "." not in k}
        settings = cls(**own, drafter=config_from(ns, DrafterConfig, "drafter"),
                       engine=config_from(ns, EngineConfig, "engine"))
        if settings.api_key is None:
            settings.api_key = os.environ.get(API_KEY_ENV) or None
        return settings
