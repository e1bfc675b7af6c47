"""The offline replay command: recorded turns (traces, the BFCL held-out split, or a dump) through
the drafter, with prompt lookup (and optional peers) beside it. See `ngram.replay` for the rule and
the figures; `python -m ngram.replay` and `python -m index.replay` are the same command.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from common.config_flags import add_flags, config_from
from common.tokenizer import load_tokenizer
from ngram.drafter import DrafterConfig, PromptLookupDrafter
from ngram.index_file import IndexLoadError, load_index
from ngram.replay import replay
from server.tool_schema import make_drafter


# SuffixDecoding's settings by peer name: the default (factor 1, paths) and its best ones
SUFFIX_PEERS = {
    "suffix": {},
    "suffix-f4": {"max_spec_factor": 4.0},
    "suffix-tree": {"use_tree_spec": True},
    "suffix-f4-tree": {"max_spec_factor": 4.0, "use_tree_spec": True},
}


def load_turns(args) -> list[tuple[np.ndarray, np.ndarray]]:
    """(context, target) id arrays from a dump, the BFCL holdout, or trace files."""
    if args.from_dump:
        rows = [json.loads(line) for line in Path(args.from_dump).read_text().splitlines() if line.strip()]
        return [(np.asarray(r["context"], dtype=np.int64), np.asarray(r["target"], dtype=np.int64)) for r in rows]
    from common.chat_format import ChatFormat
    from common.tokenizer import conversation_turns
    from index.traces import ReadReport, iter_conversations

    tok = load_tokenizer(args.tokenizer)
    fmt = ChatFormat.for_tokenizer(tok)
    report = ReadReport()
    if args.bfcl_holdout:
        from index.bfcl import bfcl_split, iter_bfcl_conversations
        from common.paths import BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED

        _, convs = bfcl_split(iter_bfcl_conversations(report=report), BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED)
    else:
        convs = list(iter_conversations(args.traces, report))
    if report.skipped:
        print(report.summary(), file=sys.stderr)
    turns = []
    for conv in convs[: args.max_conversations or None]:
        for ctx, target in conversation_turns(fmt, tok, conv.messages, conv.tools):
            turns.append((np.asarray(ctx, dtype=np.int64), np.asarray(target, dtype=np.int64)))
    return turns


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ngram.replay",
                                description="Offline replay: how well would a drafter have done on recorded "
                                            "turns? No model needed.")
    p.add_argument("--index", type=Path, help="index directory (omit to replay context-only drafting)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", nargs="+", type=Path)
    src.add_argument("--bfcl-holdout", action="store_true", help="replay the BFCL v4 held-out split")
    src.add_argument("--from-dump", type=Path, help="replay turns from a --dump file")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the bundled Gemma 3 270M)")
    # The drafter's knobs, generated from DrafterConfig as the server's are (same names); --cutoff
    # and --no-context are this command's older names for --confidence-cutoff and --no-use-context.
    add_flags(p.add_argument_group("drafting knobs (ngram.drafter.DrafterConfig)"), DrafterConfig, "drafter",
              aliases={"confidence_cutoff": ["--cutoff"], "use_context": ["--context"]})
    p.add_argument("--max-conversations", type=int, default=0)
    p.add_argument("--peers", nargs="*", default=[], choices=list(SUFFIX_PEERS),
                   help="also replay these peer drafters, seeded with the same index turns (suffix: "
                        "SuffixDecoding from arctic-inference at max_spec_factor 1, paths; suffix-f4: "
                        "factor 4; suffix-tree / suffix-f4-tree: tree speculation, factor 1 / 4)")
    p.add_argument("--dump", type=Path, help="write the replayed turns as JSONL")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object, last line")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    index = None
    if args.index:
        try:
            index = load_index(args.index)
        except IndexLoadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    turns = load_turns(args)
    if not turns:
        print("error: no assistant turns to replay", file=sys.stderr)
        return 2
    if args.dump:
        with open(args.dump, "w") as f:
            for ctx, target in turns:
                f.write(json.dumps({"context": ctx.tolist(), "target": target.tolist()}) + "\n")
    config = config_from(args, DrafterConfig, "drafter")
    k = config.max_draft
    ours = replay(make_drafter(index, config, load_tokenizer(args.tokenizer)), turns, k).as_dict()
    base = replay(PromptLookupDrafter(max_draft=k), turns, k).as_dict()
    result = {**ours, "max_draft": k, "index": str(args.index) if args.index else None, "baseline": base}
    if args.peers:
        from index.peers import SuffixDecodingDrafter

        seed_turns = list(index.turns()) if index is not None else []
        result["peers"] = {name: replay(SuffixDecodingDrafter(seed_turns, k, **SUFFIX_PEERS[name]), turns, k).as_dict()
                           for name in args.peers}
    print(
        f"turns {ours['turns']}  target tokens {ours['target_tokens']}\n"
        f"  sailfish       tau {ours['tau']:.3f}  acceptance {ours['acceptance_rate']:.3f}  "
        f"draft p50 {ours['draft_us_p50']:.1f} us  p99 {ours['draft_us_p99']:.1f} us\n"
        f"  prompt lookup  tau {base['tau']:.3f}  acceptance {base['acceptance_rate']:.3f}  "
        f"draft p50 {base['draft_us_p50']:.1f} us  p99 {base['draft_us_p99']:.1f} us",
        file=sys.stderr if args.json else sys.stdout,
    )
    for name, peer in result.get("peers", {}).items():
        print(f"  {name:<14} tau {peer['tau']:.3f}  acceptance {peer['acceptance_rate']:.3f}  "
              f"draft p50 {peer['draft_us_p50']:.1f} us  p99 {peer['draft_us_p99']:.1f} us",
              file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
