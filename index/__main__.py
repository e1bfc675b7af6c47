"""`python -m index build|distill|info`: build the n-gram index from traces, distill traces, describe an index.

build: --traces PATH [PATH ...] --out DIR [--tokenizer DIR]. Without --traces, the default sources
(see common.paths) and the BFCL starter corpus; --bfcl / --no-bfcl override the starter corpus.
Exit status: 0 on success, 2 when the input has no usable assistant turn or --out cannot be written
(checked before any work; nothing is written).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common.config_flags import within
from ngram.index_file import BuildParams


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m index", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build an index from trace files")
    b.add_argument("--traces", nargs="+", type=Path, help="trace files or directories of .jsonl files")
    b.add_argument("--out", type=Path, help="index directory (default: the server's default index)")
    b.add_argument("--tokenizer", help="local tokenizer/model directory (default: the bundled Gemma 3 270M)")
    b.add_argument("--bfcl", action=argparse.BooleanOptionalAction, default=None,
                   help="include the BFCL v4 starter corpus (default: only without --traces)")
    b.add_argument("--full", action="store_true", help="re-read every source instead of reusing unchanged ones")
    b.add_argument("--key-tokens", type=within(int, 1), default=BuildParams.key_tokens,
                   help=f"longest n-gram key, in tokens (default {BuildParams.key_tokens})")
    b.add_argument("--anchor-tokens", type=within(int, 0), default=BuildParams.anchor_tokens,
                   help=f"prompt tokens kept before each turn (default {BuildParams.anchor_tokens})")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    d = sub.add_parser("distill", help="write the target's own completions for recorded contexts as traces")
    d.add_argument("--traces", nargs="+", type=Path, required=True)
    d.add_argument("--out", type=Path, required=True, help="output OpenAI-format JSONL file")
    d.add_argument("--model", help="target model (default: the bundled Gemma 3 270M)")
    d.add_argument("--max-tokens", type=int, default=256, help="completion limit per turn")
    d.add_argument("--max-prompt", type=int, default=4096, help="skip turns whose prompt is longer")
    d.add_argument("--quiet", action="store_true")
    i = sub.add_parser("info", help="describe an index")
    i.add_argument("dir", type=Path, nargs="?")
    return p


def _refused_out(out: Path, directory: bool) -> bool:
    """Whether --out cannot be written (said on stderr), checked before any work."""
    from common.paths import unwritable

    problem = unwritable(out, directory)
    if problem:
        print(f"error: --out: {problem}", file=sys.stderr)
    return problem is not None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from common.paths import default_index_dir, default_trace_paths, describe_source

    if args.command == "info":
        from ngram.index_file import IndexLoadError, load_index

        try:
            idx = load_index(args.dir or default_index_dir())
        except IndexLoadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        meta = {k: v for k, v in idx.meta.items() if k not in ("sources", "files")}
        for k, v in meta.items():
            if k == "created" and isinstance(v, (int, float)):
                v = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(v))
            print(f"{k}: {v}")
        print(f"sources: {len(idx.meta.get('sources', {}))}")
        return 0

    if args.command == "distill":
        from index.distill import distill, load_distill_engine
        from index.traces import ReadReport, iter_conversations

        if _refused_out(args.out, directory=False):
            return 2
        report = ReadReport()
        convs = list(iter_conversations(args.traces, report))
        if report.skipped:
            print(report.summary(), file=sys.stderr)
        if not convs:
            print("error: no conversations in the traces", file=sys.stderr)
            return 2
        summary = distill(convs, args.out, load_distill_engine(args.model), args.max_tokens, args.max_prompt,
                          progress=not args.quiet)
        print(summary.text())
        return 0 if summary.turns else 2

    from index.build import NoUsableTurns, build_index

    traces = args.traces if args.traces else default_trace_paths()
    include_bfcl = args.bfcl if args.bfcl is not None else not args.traces
    out = args.out or default_index_dir()
    if _refused_out(Path(out), directory=True):
        return 2
    if not args.traces:
        shown = "; ".join(describe_source(p) for p in traces) or "none found"
        print(f"default trace sources: {shown}; BFCL v4 starter corpus: {'yes' if include_bfcl else 'no'}",
              file=sys.stderr)
    try:
        summary = build_index(
            traces, out, args.tokenizer, include_bfcl,
            BuildParams(key_tokens=args.key_tokens, anchor_tokens=args.anchor_tokens),
            incremental=not args.full, progress=not args.quiet,
        )
    except (NoUsableTurns, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
