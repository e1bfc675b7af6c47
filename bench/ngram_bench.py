"""The drafter's bars, measured in one run: `python -m bench.ngram_bench [--quick]`.

1. Index build end to end (OpenAI JSONL files on disk -> published index) on a >= 1 M-token corpus:
   tokens/s, bytes on disk per indexed token, load time (median of 5 loads).
   Corpus: the BFCL v4 index split (never the held-out split), written out `--copies` times; every
   copy after the first re-deals each tool call's string arguments among the calls of the same
   function and key (a seeded shuffle), so copies are realistic variants, not duplicates.
2. Replay of the BFCL v4 held-out split against that index, grouped as multi_turn / live / single
   (simple, multiple, parallel): tau, acceptance, draft latency p50/p99 for Sailfish and for the
   prompt-lookup baseline (transformers' algorithm, same max draft), and the ratio of the two taus;
   and, where arctic-inference is installed (`make bench` installs it), the same for SuffixDecoding
   seeded with the index's turns.
3. The copy bound of each group (bench/copy_bound.py): the tau of a drafter that knows the target
   and copies the longest run of it found in the index, the request, or an earlier replayed turn
   (the contenders learn each turn after it); no drafter that copies text (Sailfish,
   SuffixDecoding, prompt lookup) can pass it.
Writes bench/results/ngram.json and bench/results/ngram.md.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench.copy_bound import copy_bound
from bench.results import write_results
from index.replay import SUFFIX_PEERS
from index.bfcl import bfcl_split, iter_bfcl_conversations
from index.build import build_index
from common.chat_format import ChatFormat
from common.paths import BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED
from common.tokenizer import conversation_turns, load_tokenizer
from ngram.drafter import DrafterConfig, NgramDrafter, PromptLookupDrafter
from ngram.index_file import load_index
from ngram.replay import replay
from server.tool_schema import make_drafter


def _group(source: str) -> str:
    category = source.split("/", 1)[-1]
    if category.startswith("multi_turn"):
        return "multi_turn"
    if category.startswith("live"):
        return "live"
    return "single"


def _redeal_arguments(conversations, rng: random.Random) -> list[dict]:
    """Copies of the conversations with string argument values shuffled per (function, key)."""
    pools: dict[tuple[str, str], list] = defaultdict(list)
    parsed = []
    for conv in conversations:
        msgs = json.loads(json.dumps(conv.messages))
        for m in msgs:
            for call in m.get("tool_calls") or []:
                args = json.loads(call["function"]["arguments"])
                call["function"]["_args"] = args
                for k, v in args.items():
                    if isinstance(v, str):
                        pools[(call["function"]["name"], k)].append(v)
        parsed.append({"messages": msgs, "tools": conv.tools})
    for pool in pools.values():
        rng.shuffle(pool)
    cursor: dict[tuple[str, str], int] = defaultdict(int)
    for conv in parsed:
        for m in conv["messages"]:
            for call in m.get("tool_calls") or []:
                args = call["function"].pop("_args")
                for k, v in args.items():
                    key = (call["function"]["name"], k)
                    if isinstance(v, str) and pools[key]:
                        args[k] = pools[key][cursor[key] % len(pools[key])]
                        cursor[key] += 1
                call["function"]["arguments"] = json.dumps(args)
    return parsed


def build_corpus(out_dir: Path, conversations, copies: int) -> int:
    rng = random.Random(0)
    n = 0
    for copy in range(copies):
        rows = ([{"messages": c.messages, "tools": c.tools} for c in conversations] if copy == 0
                else _redeal_arguments(conversations, rng))
        with open(out_dir / f"bfcl-copy{copy}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
                n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ngram_bench", description=__doc__.split("\n")[0])
    p.add_argument("--copies", type=int, default=4, help="corpus copies (4 gives > 1 M indexed tokens)")
    p.add_argument("--quick", action="store_true", help="1 copy and 300 held-out conversations")
    p.add_argument("--max-draft", type=int, default=DrafterConfig.max_draft)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    copies = 1 if args.quick else args.copies

    keep, hold = bfcl_split(iter_bfcl_conversations(), BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED)
    if args.quick:
        hold = hold[:300]
    results: dict = {"corpus": f"BFCL v4 index split x{copies} (arguments re-dealt in copies 2..)",
                     "holdout_conversations": len(hold)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "traces").mkdir()
        results["index_conversations"] = build_corpus(tmp / "traces", keep, copies)
        summary = build_index([tmp / "traces"], tmp / "index", progress=False)
        loads = []
        for _ in range(5):
            t0 = time.perf_counter()
            index = load_index(tmp / "index")
            loads.append(time.perf_counter() - t0)
        results["build"] = {
            "indexed_tokens": summary.tokens, "turns": summary.turns, "seconds": summary.seconds,
            "tokens_per_s": summary.tokens / summary.seconds, "bytes": summary.bytes,
            "bytes_per_token": summary.bytes / summary.tokens, "load_s_median": statistics.median(loads),
            "load_s_max": max(loads),
        }
        tok = load_tokenizer()
        fmt = ChatFormat.for_tokenizer(tok)
        groups: dict[str, list] = defaultdict(list)
        for conv in hold:
            for ctx, target in conversation_turns(fmt, tok, conv.messages, conv.tools):
                groups[_group(conv.source)].append((np.asarray(ctx), np.asarray(target)))
        groups["all"] = [t for g in list(groups.values()) for t in g]
        suffix = _suffix_decoding(index, args.max_draft)
        seed_turns = list(index.turns())
        results["replay"] = {}
        for name, turns in groups.items():
            config = DrafterConfig(max_draft=args.max_draft)
            ours = replay(make_drafter(index, config, tok), turns, args.max_draft).as_dict()
            bare = replay(NgramDrafter(index, config), turns, args.max_draft).as_dict()  # --no-tool-schema
            base = replay(PromptLookupDrafter(max_draft=args.max_draft), turns, args.max_draft).as_dict()
            bound = copy_bound([turns], seed_turns, args.max_draft, learn=True).as_dict()
            results["replay"][name] = {"sailfish": ours, "sailfish_no_tool_schema": bare, "prompt_lookup": base,
                                       "tau_ratio": ours["tau"] / base["tau"],
                                       "copy_bound": {k: bound[k] for k in ("tau", "target_tokens", "verify_steps")}}
            if suffix is not None:  # every setting; `suffix_decoding` stays the default one (factor 1, paths)
                settings = {peer: replay(suffix(peer), turns, args.max_draft).as_dict() for peer in SUFFIX_PEERS}
                results["replay"][name]["suffix_decoding"] = settings["suffix"]
                results["replay"][name]["suffix_decoding_settings"] = settings
    md = _markdown(results)
    write_results(args.out, "ngram", results, md)
    print(md)
    return 0


def _suffix_decoding(index, max_draft: int):
    """A factory of fresh SuffixDecoding drafters seeded with the index's turns, by setting name
    (index.replay.SUFFIX_PEERS), or None when arctic-inference is not installed."""
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is None:
        return None
    from index.peers import SuffixDecodingDrafter

    seed = list(index.turns())
    return lambda peer: SuffixDecodingDrafter(seed, max_draft, **SUFFIX_PEERS[peer])


def _markdown(r: dict) -> str:
    b = r["build"]
    lines = [
        f"Index: {r['corpus']}, {b['indexed_tokens']:,} indexed tokens, {b['turns']:,} turns.",
        f"Build {b['seconds']:.1f} s end to end ({b['tokens_per_s']:,.0f} tokens/s), "
        f"{b['bytes_per_token']:.1f} bytes/token on disk, load {b['load_s_median'] * 1000:.1f} ms median "
        f"(max {b['load_s_max'] * 1000:.1f} ms).",
        "",
        f"Replay of {r['holdout_conversations']} held-out BFCL v4 conversations:",
        "",
        "| turns | n | tau Sailfish | tau without tool schema | tau prompt lookup | ratio | accept Sailfish | accept PL "
        "| p50 us | p99 us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, g in r["replay"].items():
        s, pl = g["sailfish"], g["prompt_lookup"]
        bare = g.get("sailfish_no_tool_schema", {}).get("tau")
        lines.append(f"| {name} | {s['turns']} | {s['tau']:.2f} | {'-' if bare is None else f'{bare:.2f}'} | "
                     f"{pl['tau']:.2f} | {g['tau_ratio']:.2f}x | "
                     f"{s['acceptance_rate']:.2f} | {pl['acceptance_rate']:.2f} | {s['draft_us_p50']:.0f} | {s['draft_us_p99']:.0f} |")
    lines += ["", "'Without tool schema': the same drafter with `--no-tool-schema` (server/tool_schema.py off)."]
    peers = [(name, g["suffix_decoding_settings"]) for name, g in r["replay"].items() if "suffix_decoding_settings" in g]
    if peers:
        names = list(peers[0][1])
        lines += ["", "SuffixDecoding (arctic-inference), seeded with the index's turns, on the same held-out turns, "
                  "at each setting (f4: max_spec_factor 4; tree: tree speculation); tau, and Sailfish's tau over the "
                  "best of them:", "",
                  "| turns | " + " | ".join(f"tau {n}" for n in names) + " | Sailfish / best | best's p50 / p99 us "
                  "| copy bound | Sailfish / bound | 1.2x best / bound |",
                  "|---|" + "---|" * (len(names) + 5)]
        for name, settings in peers:
            ours = r["replay"][name]["sailfish"]["tau"]
            best = max(settings.values(), key=lambda sd: sd["tau"])
            bound = r["replay"][name].get("copy_bound", {}).get("tau")
            of_bound = (f" | {bound:.2f} | {ours / bound:.0%} | {1.2 * best['tau'] / bound:.0%} |" if bound
                        else " | - | - | - |")
            lines.append(f"| {name} | " + " | ".join(f"{settings[n]['tau']:.2f}" for n in names)
                         + f" | {ours / best['tau']:.2f}x | {best['draft_us_p50']:.0f} / {best['draft_us_p99']:.0f}"
                         + of_bound)
        lines += ["", "Copy bound: the tau of a drafter that knows the target and copies the longest run of it that "
                  "occurs in the index, the request so far or an earlier replayed turn (bench/copy_bound.py); no drafter that copies text "
                  "reaches past it. '1.2x best / bound': how much of that ceiling a drafter 1.2x the best "
                  "SuffixDecoding setting would need."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
