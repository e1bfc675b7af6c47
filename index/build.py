"""Traces in, index out: `python -m index build`.

Contract: `build_index(trace_paths, out_dir, tokenizer_dir, include_bfcl, params)` reads every trace
file (see index.traces for formats), renders each assistant turn in the target's format, tokenizes it
with the target tokenizer, and publishes an n-gram index (ngram.index_file) atomically. It returns a
BuildSummary. Malformed lines are skipped and reported with file and line; an input with no usable
assistant turn raises NoUsableTurns and writes nothing.

Incremental rebuilds: the index records each source (file path, size, mtime; or the BFCL starter
corpus and its version) with its range of turns. When `out_dir` already holds an index built with the
same tokenizer and parameters, unchanged sources reuse their stored tokens and only new or changed
files are read and tokenized; the trie itself is always rebuilt from the whole corpus.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.chat_format import ChatFormat
from common.paths import BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED
from common.tokenizer import indexed_turns, load_tokenizer, tokenizer_fingerprint
from index.traces import ReadReport, iter_conversations, trace_files
from ngram.index_file import BuildParams, IndexLoadError, load_index, write_index

BFCL_SOURCE = "bfcl-v4-starter"


class NoUsableTurns(ValueError):
    pass


@dataclass
class BuildSummary:
    conversations: int = 0
    turns: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    reused_sources: int = 0
    read_sources: int = 0
    path: str = ""
    report: ReadReport = field(default_factory=ReadReport)

    def text(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        lines = [
            f"index written to {self.path}",
            f"  conversations {self.conversations:,}  turns {self.turns:,}  tokens {self.tokens:,}",
            f"  bytes {self.bytes:,} ({self.bytes / max(self.tokens, 1):.1f} per token)  "
            f"seconds {self.seconds:.1f} ({rate:,.0f} tokens/s)",
            f"  sources read {self.read_sources}, reused from the previous index {self.reused_sources}",
        ]
        if self.report.skipped:
            lines.append(self.report.summary())
        return "\n".join(lines)


def _trace_files(paths: list[Path], report: ReadReport) -> list[Path]:
    """index.traces.trace_files, but a named path that does not exist is an error (a typo in
    --traces must not build an index without it)."""
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"trace path {p} does not exist")
    return list(trace_files(paths, report))


def _bfcl_signature() -> str:
    from importlib.metadata import version

    return f"bfcl-eval {version('bfcl-eval')} holdout {BFCL_HOLDOUT_FRACTION} seed {BFCL_SPLIT_SEED}"


def bfcl_index_conversations(report: ReadReport | None = None) -> list:
    from index.bfcl import bfcl_split, iter_bfcl_conversations

    keep, _ = bfcl_split(iter_bfcl_conversations(report=report), BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED)
    return keep


def _previous(out_dir: Path, fingerprint: str, params: BuildParams):
    try:
        old = load_index(out_dir, expected_fingerprint=fingerprint)
    except IndexLoadError:
        return None
    if old.params != params:
        return None
    return old


def build_index(
    trace_paths: list[Path],
    out_dir: Path,
    tokenizer_dir: str | None = None,
    include_bfcl: bool = False,
    params: BuildParams = BuildParams(),
    incremental: bool = True,
    progress: bool = True,
) -> BuildSummary:
    from tqdm import tqdm

    started = time.perf_counter()
    summary = BuildSummary()
    tok = load_tokenizer(tokenizer_dir)
    fmt = ChatFormat.for_tokenizer(tok)
    fingerprint = tokenizer_fingerprint(tok)
    previous = _previous(Path(out_dir), fingerprint, params) if incremental else None
    old_sources = previous.meta.get("sources", {}) if previous is not None else {}

    files = _trace_files(trace_paths, summary.report)
    units: list[tuple[str, str]] = [(str(f.resolve()), _file_signature(f)) for f in files]
    if include_bfcl:
        units.append((BFCL_SOURCE, _bfcl_signature()))

    turns: list[np.ndarray] = []
    sources: dict[str, dict] = {}
    bar = tqdm(units, desc="indexing", unit="source", disable=not progress, file=sys.stderr)
    for key, signature in bar:
        start = len(turns)
        old = old_sources.get(key)
        if old is not None and old["signature"] == signature:
            offsets = previous.offsets
            for i in range(old["turn_start"], old["turn_end"]):
                turns.append(np.array(previous.corpus[offsets[i] : offsets[i + 1]], dtype=np.uint32))
            summary.reused_sources += 1
            summary.conversations += old.get("conversations", 0)
        else:
            unreadable = len(summary.report.unreadable)
            convs = bfcl_index_conversations(summary.report) if key == BFCL_SOURCE else list(iter_conversations([key], summary.report))
            unrendered = lambda conv, e: summary.report.skip(conv.source, conv.line,
                                                              f"cannot be rendered ({type(e).__name__}: {e})")
            turns.extend(np.asarray(t, dtype=np.uint32)
                         for t in indexed_turns(fmt, tok, convs, params.anchor_tokens, on_error=unrendered))
            summary.read_sources += 1
            summary.conversations += len(convs)
            old = {"conversations": len(convs)}
            if len(summary.report.unreadable) > unreadable:
                continue  # it could not be read: not kept as read, so the next build tries it again
        sources[key] = {"signature": signature, "turn_start": start, "turn_end": len(turns),
                        "conversations": old.get("conversations", 0)}
    if not turns:
        detail = f"\n{summary.report.summary()}" if summary.report.skipped else ""
        raise NoUsableTurns(f"no usable assistant turns in {len(units)} source(s); nothing was written{detail}")
    generation = write_index(out_dir, turns, fingerprint, params, extra_meta={
        "tokenizer": Path(str(getattr(tok, "name_or_path", ""))).name,  # a name, not a machine path
        "sources": sources,
        "conversations": summary.conversations,
    })
    summary.turns = len(turns)
    summary.tokens = int(sum(len(t) for t in turns))
    summary.bytes = sum(p.stat().st_size for p in generation.iterdir())
    summary.path = str(Path(out_dir))
    summary.seconds = time.perf_counter() - started
    return summary


def _file_signature(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"
