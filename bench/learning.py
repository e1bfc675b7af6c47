"""The personal learning loop, measured (issue 7): `python -m bench.learning [--quick]`.

1. Distillation: BFCL v4 single-turn conversations from the index split are distilled through the
   target (`index.distill`); an index built from the distilled traces and one built from the original
   traces are replayed (ngram.replay) on held-out turns whose targets are the target's own greedy
   replies (held-out BFCL conversations, distilled too). Reported: tau both ways and the gain.
2. The scenario: a live server (real HTTP, real trace log) starts on the starter index (BFCL v4
   index split) and serves a first batch of agent-style requests (bench.workloads agentic sessions),
   which the trace log captures; the index is rebuilt from the starter corpus plus those traces (the
   code behind `make index`) and reloaded through POST /admin/reload-index; then a second batch of
   similar but different requests (other stdlib modules) is served with the starter index and with
   the rebuilt one, request by request in turn. The online overlay is off here, so the gain shown is
   the rebuilt index's alone. Reported: replay tau and served decode tokens/s on the second batch,
   both ways, and whether the outputs are identical.
Writes bench/results/learning.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


from bench.results import write_results


def _write_jsonl(path: Path, conversations) -> None:
    with open(path, "w") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c.messages, "tools": c.tools}) + "\n")


def _replay_tau(index_dir: Path | None, traces: Path, *extra: str) -> dict:
    from index.replay import main as replay_main
    import contextlib
    import io

    buf = io.StringIO()
    args = ["--traces", str(traces), "--json", *extra] + (["--index", str(index_dir)] if index_dir else [])
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        replay_main(args)
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def distillation(engine, tmp: Path, n_train: int, n_hold: int, max_tokens: int) -> dict:
    from index.bfcl import bfcl_split, iter_bfcl_conversations
    from index.build import build_index
    from index.distill import distill
    from common.paths import BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED

    single = ["simple_python", "live_simple", "multiple"]
    keep, hold = bfcl_split(iter_bfcl_conversations(single), BFCL_HOLDOUT_FRACTION, BFCL_SPLIT_SEED)
    train, held = keep[:n_train], hold[:n_hold]
    _write_jsonl(tmp / "train.jsonl", train)
    d_train = distill(train, tmp / "distilled" / "train.jsonl", engine, max_tokens, progress=False)
    distill(held, tmp / "heldout-target.jsonl", engine, max_tokens, progress=False)
    build_index([tmp / "train.jsonl"], tmp / "idx-original", progress=False)
    build_index([tmp / "distilled"], tmp / "idx-distilled", progress=False)
    original = _replay_tau(tmp / "idx-original", tmp / "heldout-target.jsonl")
    distilled = _replay_tau(tmp / "idx-distilled", tmp / "heldout-target.jsonl")
    # what the index alone predicts (the request's own context left out), where distillation acts
    original_only = _replay_tau(tmp / "idx-original", tmp / "heldout-target.jsonl", "--no-context")
    distilled_only = _replay_tau(tmp / "idx-distilled", tmp / "heldout-target.jsonl", "--no-context")
    return {"train_conversations": len(train), "heldout_conversations": len(held),
            "distill_seconds": d_train.seconds, "tau_original": original["tau"], "tau_distilled": distilled["tau"],
            "tau_gain": distilled["tau"] / original["tau"], "prompt_lookup_tau": original["baseline"]["tau"],
            "index_only_tau_original": original_only["tau"], "index_only_tau_distilled": distilled_only["tau"],
            "index_only_tau_gain": distilled_only["tau"] / original_only["tau"]}


def scenario(target, tmp: Path, batch: int, max_tokens: int) -> dict:
    import openai

    from bench.workloads import agentic_requests
    from index.build import build_index
    from ngram.drafter import DrafterConfig, NgramDrafter
    from ngram.index_file import load_index
    from bench.live_server import ServerThread
    from server.app import create_app
    from server.engine import Engine, EngineConfig
    from server.serving import Service
    from server.settings import Settings

    home = tmp / "home"
    os.environ["SAILFISH_HOME"] = str(home)
    index_dir = home / "index"
    build_index([], index_dir, include_bfcl=True, progress=False)
    settings = Settings(index=index_dir, trace_dir=home / "traces", watch_index=0,
                        drafter=DrafterConfig(overlay_tokens=0))
    starter = NgramDrafter(load_index(index_dir), settings.drafter)
    engine = Engine(target, starter, EngineConfig())
    service = Service(engine, settings)
    requests = [r for r in agentic_requests(2 * batch + 2) if r["id"].startswith("stdlib")]
    first, second = requests[:batch], requests[batch : 2 * batch]
    with ServerThread(create_app(service)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

        def ask(req):
            r = client.chat.completions.create(model="m", messages=req["messages"], tools=req["tools"], max_tokens=max_tokens)
            return r.choices[0].message.model_dump(), r.usage.model_extra["sailfish"]

        for req in first:
            ask(req)
        service.trace_log = None  # the second batch must not leak into the rebuilt index
        summary = build_index([home / "traces"], index_dir, include_bfcl=True, progress=False)
        reloaded = openai.OpenAI(base_url=url, api_key="none").post("/admin/reload-index", cast_to=dict, body={})
        rebuilt = engine._drafter
        rows = []
        for req in second:
            engine.set_drafter(starter)
            a, ua = ask(req)
            engine.set_drafter(rebuilt)
            b, ub = ask(req)
            rows.append({"id": req["id"], "starter_tok_s": ua["decode_tokens_per_s"], "rebuilt_tok_s": ub["decode_tokens_per_s"],
                         "identical": a == b, "reply": a})
    # replay the second batch's turns (the target's own replies) against both indexes
    with open(tmp / "second.jsonl", "w") as f:
        for req, row in zip(second, rows):
            reply = {k: v for k, v in row.pop("reply").items() if k in ("role", "content", "tool_calls") and v}
            f.write(json.dumps({"messages": req["messages"] + [reply], "tools": req["tools"]}) + "\n")
    gens = sorted(index_dir.glob("gen-*"), key=lambda p: int(p.name[4:]))
    tau_starter = _replay_tau(starter.index.path, tmp / "second.jsonl")["tau"]
    tau_rebuilt = _replay_tau(gens[-1], tmp / "second.jsonl")["tau"]
    ratio = [r["rebuilt_tok_s"] / r["starter_tok_s"] for r in rows if r["starter_tok_s"]]
    return {"first_batch": len(first), "second_batch": len(second), "rebuilt_tokens": summary.tokens,
            "reload": reloaded, "tau_starter": tau_starter, "tau_rebuilt": tau_rebuilt, "tau_gain": tau_rebuilt / tau_starter,
            "tok_s_starter": statistics.median(r["starter_tok_s"] for r in rows),
            "tok_s_rebuilt": statistics.median(r["rebuilt_tok_s"] for r in rows),
            "tok_s_gain_median": statistics.median(ratio), "tok_s_gain_min": min(ratio), "tok_s_gain_max": max(ratio),
            "identical": sum(r["identical"] for r in rows), "requests": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learning", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["distillation", "scenario"], help="run one part (the other keeps its last figures)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    from ngram.drafter import NgramDrafter
    from server.engine import Engine, EngineConfig
    from server.model_loading import load_target

    started = time.perf_counter()
    target = load_target(None)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        engine = Engine(target, NgramDrafter(None), EngineConfig())
        n_train, n_hold, batch = (8, 4, 3) if args.quick else (24, 8, 6)
        previous = json.loads((args.out / "learning.json").read_text()) if args.only and (args.out / "learning.json").exists() else {}
        results["distillation"] = (distillation(engine, tmp, n_train, n_hold, 48) if args.only != "scenario"
                                   else previous["distillation"])
        results["scenario"] = scenario(target, tmp, batch, 48) if args.only != "distillation" else previous["scenario"]
    results["seconds"] = time.perf_counter() - started
    d, s = results["distillation"], results["scenario"]
    md = (f"Distillation ({d['train_conversations']} BFCL conversations distilled, {d['heldout_conversations']} held out): "
          f"replay tau on the target's own held-out replies {d['tau_original']:.2f} with the original traces' index, "
          f"{d['tau_distilled']:.2f} with the distilled one ({d['tau_gain']:.2f}x; prompt lookup {d['prompt_lookup_tau']:.2f}); "
          f"from the index alone (no live-context drafting) {d['index_only_tau_original']:.2f} -> "
          f"{d['index_only_tau_distilled']:.2f} ({d['index_only_tau_gain']:.2f}x).\n\n"
          f"Scenario ({s['first_batch']} agent requests served and captured, index rebuilt (+{s['rebuilt_tokens']:,} tokens in all) "
          f"and reloaded, {s['second_batch']} new requests): replay tau {s['tau_starter']:.2f} -> {s['tau_rebuilt']:.2f} "
          f"({s['tau_gain']:.2f}x); served decode tokens/s median {s['tok_s_starter']:.2f} -> {s['tok_s_rebuilt']:.2f} "
          f"(per-request ratio median {s['tok_s_gain_median']:.2f}x, {s['tok_s_gain_min']:.2f}..{s['tok_s_gain_max']:.2f}); "
          f"outputs identical {s['identical']}/{s['second_batch']}. The last run ({args.only or 'both parts'}) took "
          f"{results['seconds'] / 60:.1f} min.\n")
    write_results(args.out, "learning", results, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
