"""Where Sailfish keeps its data, and which traces the default index is built from.

- `SAILFISH_HOME` (default `~/.local/share/sailfish`) holds:
    traces/   the server's own trace log (completed chat requests, OpenAI JSONL); indexed by default
    index/    the default index, read by the server
- Default trace sources for `make index` / `python -m index build` without `--traces`:
    $SAILFISH_HOME/traces, ~/.claude/projects (Claude Code sessions) when present, every directory
    in `SAILFISH_TRACE_DIRS` (os.pathsep-separated), and the public BFCL v4 starter corpus (the
    `bfcl-eval` package) minus its held-out split, which benchmarks replay against.
- `unwritable(path, directory)` says why an output (the index, a distilled file, the trace log)
  cannot be written, so commands refuse it before doing any work.
"""
from __future__ import annotations

import os
from pathlib import Path

BFCL_HOLDOUT_FRACTION = 0.2
BFCL_SPLIT_SEED = 0


def sailfish_home() -> Path:
    return Path(os.environ.get("SAILFISH_HOME", Path.home() / ".local" / "share" / "sailfish"))


def default_trace_dir() -> Path:
    return sailfish_home() / "traces"


def default_index_dir() -> Path:
    return sailfish_home() / "index"


def claude_code_dir() -> Path:
    return Path.home() / ".claude" / "projects"


def default_trace_paths() -> list[Path]:
    paths = [default_trace_dir()]
    if claude_code_dir().is_dir():
        paths.append(claude_code_dir())
    extra = os.environ.get("SAILFISH_TRACE_DIRS", "")
    paths.extend(Path(p) for p in extra.split(os.pathsep) if p)
    return [p for p in paths if p.exists()]


def describe_source(path: Path) -> str:
    """`path` with how many trace files (*.jsonl) it holds, saying so when it holds none yet."""
    files = 1 if path.is_file() else sum(1 for f in path.rglob("*.jsonl") if f.is_file())
    label = "Claude Code sessions" if path == claude_code_dir() else "trace files"
    if files:
        return f"{path} ({files:,} {label[:-1] if files == 1 else label})"
    why = ("Claude Code writes one per session as you use it" if path == claude_code_dir()
           else "the server logs every completed chat request here" if path == default_trace_dir()
           else "nothing to index")
    return f"{path} (no {label} yet: {why})"


def unwritable(path: Path, directory: bool) -> str | None:
    """Why `path` cannot be written as an output (a directory to create or fill, or a file), checked
    before any work is done; None when it can."""
    if path.exists() and path.is_dir() != directory:
        return f"{path} exists and is {'not ' if directory else ''}a directory"
    parent = path if path.exists() else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None
