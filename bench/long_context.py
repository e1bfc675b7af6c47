"""Long agent conversations through the drafters, offline: tau and propose latency by context length.

    python -m bench.long_context [--chains 3] [--max-context 131072] [--max-draft 16] [--quick]
                                 [--split all|dev|test] [--out bench/results]

`--split`: the conversations are cut into two halves by a hash of their question (split_of); the
drafter's settings are tuned on `dev`, and `test` is the held-out figure.

The conversations (real recorded ones, never generated text): the held-out BFCL v4 multi-turn
conversations (the default index never saw them) and the Claude Code sample transcripts, CHAINED
into `--chains` long agent conversations: each conversation's turns are replayed with every earlier
conversation of its chain (rendered and tokenized whole, the way the server renders them) in front
of them, as an agent that works through task after task in one context, until the context reaches
`--max-context` tokens. Conversations are dealt round-robin to the chains, so every chain mixes
tool sets; BFCL's four multi-turn categories ask the same numbered questions, so only one variant
of each question is used. What this measures is what an agent's context does to a drafter: it grows past 100k
tokens, it repeats tool declarations, calls and results, and only its tail is new.

Contenders, replayed on the same turns with the same tokens per verify (`--max-draft`), each drafter
learning its own served turns as it goes (ngram.replay's rule):
- `sailfish`: the default drafter (index, whole-context search, online overlay, tool calls' openings
  from the request's declarations: server/tool_schema.py);
- `sailfish, no tool schema`: the same without the declarations (`--no-tool-schema`);
- `sailfish, window 4096`: the same with the live-context search cut to the last 4,096 tokens (the
  default before whole-context search);
- `sailfish, trees`: the same with token trees (`--tree`: other sources' continuations as branches
  where the chosen draft leaves room; a tree's verify accepts its longest matching root path);
- `prompt lookup`: transformers' prompt lookup on the request's own context;
- `suffix f1 path`, `suffix f4 path`, `suffix f1 tree`, `suffix f4 tree`: SuffixDecoding
  (arctic-inference) seeded with the same index turns, at `max_spec_factor` 1 and 4, tree
  speculation off and on (a tree verify accepts its longest matching root path).
Beside them, `copy bound` (bench/copy_bound.py): the tau of a drafter that knows the target and
proposes the longest run of it found anywhere in the index or the request's tokens so far, which
bounds every drafter above (each proposes runs of text it has seen).
Tau = target tokens / verify steps (a tree's verify is one step). Latency = wall time of each
propose call, by the context length at the call; `prepare` = each turn's session.prepare(prompt)
(encoding the prompt and indexing its new tokens, which the server does before the prefill).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bench.results import run_header, write_results

BUCKETS = [(0, 8192), (8192, 32768), (32768, 65536), (65536, 1 << 30)]


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo // 1024}k-{hi // 1024}k" if hi < 1 << 30 else f">= {lo // 1024}k"


SPLITS = ("all", "dev", "test")


def split_of(conversation_id: str) -> str:
    """"dev" or "test": a conversation's half, fixed by a hash of its question (every BFCL variant
    of a question falls in the same half), so tuning on dev never sees a test conversation."""
    import zlib

    from bench.sessions import variant_key

    return "test" if zlib.crc32(variant_key(conversation_id).encode()) % 2 else "dev"


def chained_turns(chains: int, max_context: int, notes: list[str],
                  split: str = "all") -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """`chains` lists of (context, target) id arrays, in replay order (see the module docstring),
    from the conversations of `split` ("all", or the "dev" or "test" half: split_of)."""
    from bench.sessions import BFCL_MULTI_TURN, DEFAULT_CLAUDE_SAMPLES, load_conversations, variant_key
    from common.chat_format import ChatFormat
    from common.tokenizer import conversation_turns, load_tokenizer

    tok = load_tokenizer(None)
    fmt = ChatFormat.for_tokenizer(tok)
    convs = load_conversations(DEFAULT_CLAUDE_SAMPLES, list(BFCL_MULTI_TURN), notes)
    seen: set[str] = set()  # BFCL's four multi-turn categories repeat each question: one variant each
    convs = [c for c in convs if not (variant_key(c.id) in seen or seen.add(variant_key(c.id)))]
    if split != "all":
        convs = [c for c in convs if split_of(c.id) == split]
    out: list[list] = [[] for _ in range(chains)]
    history: list[list[int]] = [[] for _ in range(chains)]
    for i, conv in enumerate(convs):
        c = i % chains
        if len(history[c]) >= max_context:
            continue
        turns = conversation_turns(fmt, tok, conv.messages, conv.tools)
        for ctx, target in turns:
            if target and len(history[c]) + len(ctx) < max_context:
                out[c].append((np.asarray(history[c] + ctx, dtype=np.int64), np.asarray(target, dtype=np.int64)))
        if turns:
            last_ctx, last_target = turns[-1]
            history[c] = history[c] + last_ctx + last_target
    return out


def contenders(index, max_draft: int, quick: bool, tokenizer=None) -> dict:
    """name -> a function making a fresh drafter (each chain starts from the index alone)."""
    from ngram.drafter import DrafterConfig, NgramDrafter, PromptLookupDrafter
    from server.tool_schema import make_drafter

    out = {
        "sailfish": lambda: make_drafter(index, DrafterConfig(max_draft=max_draft), tokenizer),
        "sailfish, no tool schema": lambda: NgramDrafter(index, DrafterConfig(max_draft=max_draft)),
        "sailfish, window 4096": lambda: make_drafter(index, DrafterConfig(max_draft=max_draft, context_window=4096),
                                                      tokenizer),
        "sailfish, trees": lambda: make_drafter(index, DrafterConfig(max_draft=max_draft, tree=True), tokenizer),
        "prompt lookup": lambda: PromptLookupDrafter(max_draft=max_draft),
    }
    try:
        from index.peers import SuffixDecodingDrafter
        import arctic_inference  # noqa: F401  (the peer's package: `make bench` installs it)
    except ImportError:
        return out
    seed = list(index.turns()) if index is not None else []
    for factor in (1.0, 4.0):
        for tree in (False, True):
            if quick and factor == 1.0 and tree:
                continue
            out[f"suffix f{factor:g} {'tree' if tree else 'path'}"] = (
                lambda f=factor, t=tree: SuffixDecodingDrafter(seed, max_draft, max_spec_factor=f, use_tree_spec=t))
    return out


def replay_chains(make_drafter, chains, max_draft: int) -> dict:
    from ngram.replay import ReplayStats, replay_turn

    total = ReplayStats()
    per_bucket = {b: ReplayStats() for b in BUCKETS}
    t0 = time.perf_counter()
    for chain in chains:
        drafter = make_drafter()
        for ctx, target in chain:
            b = next(b for b in BUCKETS if b[0] <= len(ctx) < b[1])
            stats = ReplayStats()
            replay_turn(drafter, ctx, target, max_draft, stats)
            for s in (total, per_bucket[b]):
                s.turns += stats.turns
                s.target_tokens += stats.target_tokens
                s.verify_steps += stats.verify_steps
                s.drafted += stats.drafted
                s.accepted += stats.accepted
                s.latencies_us += stats.latencies_us
                s.prepare_us += stats.prepare_us
    return {"all": total.as_dict(), "seconds": time.perf_counter() - t0,
            "buckets": {bucket_name(*b): s.as_dict() for b, s in per_bucket.items() if s.turns}}


def markdown(r: dict) -> str:
    names = list(r["contenders"])
    lines = ["# Drafters on long agent conversations\n",
             f"{r['when']}, {r['machine']}. Command: `{r['command']}`.\n",
             f"{r['chains']} chained conversations, {r['turns']} turns, {r['target_tokens']:,} target tokens, "
             f"contexts up to {r['longest_context']:,} tokens; at most {r['max_draft']} tokens per verify. "
             f"Index: {r['index']}.\n", *[f"- {n}" for n in r["notes"]], "",
             "| contender | tau | acceptance | propose p50 (us) | propose p99 (us) | prepare p50 / p99 (us, per turn) |",
             "|---|---|---|---|---|---|"]
    for n in names:
        a = r["contenders"][n]["all"]
        lines.append(f"| {n} | {a['tau']:.2f} | {a['acceptance_rate']:.2f} | {a['draft_us_p50']:.1f} | "
                     f"{a['draft_us_p99']:.1f} | {a['prepare_us_p50']:.0f} / {a['prepare_us_p99']:.0f} |")
    if "copy bound" in r:
        b = r["copy bound"]
        lines += ["", f"Copy bound (no drafter that copies runs of the index or the context can do better): tau "
                      f"{b['tau']:.2f}; Sailfish reaches {r['contenders']['sailfish']['all']['tau'] / b['tau']:.0%} of it."]
    best_peer = max((n for n in names if n.startswith("suffix")), key=lambda n: r["contenders"][n]["all"]["tau"], default=None)
    if best_peer:
        best = r["contenders"][best_peer]["all"]["tau"]
        ratio = r["contenders"]["sailfish"]["all"]["tau"] / best
        lines += ["", f"Sailfish tau / the best SuffixDecoding configuration ({best_peer}): {ratio:.2f}x"]
        if "copy bound" in r:
            lines[-1] += (f"; a drafter 1.2x as good as it would need {1.2 * best / r['copy bound']['tau']:.0%} "
                          "of the copy bound")
    buckets = list(r["contenders"]["sailfish"]["buckets"])
    lines += ["", "By context length at the turn (tau; propose p50 / p99 us):", "",
              "| contender | " + " | ".join(buckets) + " |", "|---|" + "---|" * len(buckets)]
    for n in names:
        cells = []
        for b in buckets:
            s = r["contenders"][n]["buckets"].get(b)
            cells.append(f"{s['tau']:.2f}; {s['draft_us_p50']:.0f} / {s['draft_us_p99']:.0f}" if s else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.long_context", description=__doc__.split("\n")[0])
    p.add_argument("--chains", type=int, default=3)
    p.add_argument("--max-context", type=int, default=131_072)
    p.add_argument("--max-draft", type=int, default=16)
    p.add_argument("--index", type=Path, help="index directory (default: the default index)")
    p.add_argument("--quick", action="store_true", help="one chain to 32k tokens, fewer peers")
    p.add_argument("--split", choices=SPLITS, default="all",
                   help="replay every conversation, or only the dev or the test half (tune on dev, report test)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    from common.paths import default_index_dir
    from ngram.index_file import IndexLoadError, load_index

    if args.quick:
        args.chains, args.max_context = 1, 32_768
    index_dir = args.index or default_index_dir() / "current"
    try:
        index = load_index(index_dir)
    except IndexLoadError as e:
        print(f"error: {e} (build one with `python -m index build`)", file=sys.stderr)
        return 2
    notes: list[str] = []
    chains = chained_turns(args.chains, args.max_context, notes, args.split)
    turns = [t for c in chains for t in c]
    if not turns:
        print("error: no conversations to replay (is bfcl-eval installed?)", file=sys.stderr)
        return 2
    results = {**run_header(),
               "command": "python -m bench.long_context" + (" --quick" if args.quick else "")
                          + (f" --max-draft {args.max_draft}" if args.max_draft != 16 else "")
                          + (f" --split {args.split}" if args.split != "all" else ""),
               "split": args.split,
               "chains": len(chains), "turns": len(turns), "max_draft": args.max_draft,
               "target_tokens": int(sum(len(t) for _, t in turns)),
               "longest_context": int(max(len(c) for c, _ in turns)),
               "index": "the default index" if args.index is None else str(args.index), "notes": notes,
               "contenders": {}}
    from common.tokenizer import load_tokenizer

    for name, make in contenders(index, args.max_draft, args.quick, load_tokenizer(None)).items():
        r = replay_chains(make, chains, args.max_draft)
        results["contenders"][name] = r
        a = r["all"]
        print(f"  {name:<24} tau {a['tau']:.3f}  acceptance {a['acceptance_rate']:.3f}  "
              f"p50 {a['draft_us_p50']:.1f} us  p99 {a['draft_us_p99']:.1f} us  ({r['seconds']:.0f} s)", file=sys.stderr)
    from bench.copy_bound import copy_bound

    bound = copy_bound(chains, list(index.turns()) if index is not None else [], args.max_draft).as_dict()
    results["copy bound"] = {k: bound[k] for k in ("tau", "target_tokens", "verify_steps")}
    print(f"  {'copy bound':<24} tau {bound['tau']:.3f}", file=sys.stderr)
    md = markdown(results)
    name = "long_context" + ("-quick" if args.quick else "") + (f"-{args.max_draft}" if args.max_draft != 16 else "")
    write_results(args.out, name + (f"-{args.split}" if args.split != "all" else ""), results, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
