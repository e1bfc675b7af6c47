"""A/B of the engine's drought rule: plain steps of a drafting request chained on the device.

    python -m bench.drought_ab [--rounds 3] [--gen 256] [--out DIR]     (GPU machine)
    python -m bench.drought_ab --tiny --rounds 1                        (any machine: the harness)

Contract: one process, the E4B shape (random init, quanto int4, as bench.gpu_e4b builds it) served
by `server.engine.Engine` on the fast path as the server builds it (CUDA graphs, early launches,
device-chained plain steps), a 1,000-token prompt and `--gen` tokens a request, greedy. The plain
output (no drafter) is recorded first; the drafter is then scripted on it, so that where drafts
come and where they do not is the same in every run:
  - "drought": it never proposes (reasoning-style text: every step plain);
  - "mixed": it proposes the true continuation (16 tokens) on windows of 16 positions and nothing
    on the 48 between (droughts of 48 plain steps, each ended by drafts that are all accepted);
  - "drafted": it always proposes the true continuation (the rule never engages: its cost, none).
Each workload runs with `server.engine.DROUGHT_STEPS` None (the rule off: a drafting request's plain
steps each wait for the host) and at the shipped value, alternating, `--rounds` times each, in one
process (the rule is read per request). Reported: tokens/s of each (the request's decode, its
prefill excluded: `RequestStats.tokens_per_s`), medians and ranges, the plain and verify steps,
how many steps were chained (`RequestStats.chained_steps`), and whether every output
equals the plain output token for token (the bench raises otherwise).
`--tiny`: a tiny random Gemma 4 on the CPU, on an uncaptured fast path told that it chains (its
`step_after_argmax` is then argmax-then-step): checks the harness and the rule's bookkeeping; its
times mean nothing. Writes DIR/drought_ab.json and .md (default bench/results/).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from bench.gpu_e4b import IdTokenizer, OracleDrafter, engine_run

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 1000
WINDOW, GAP = 16, 48   # "mixed": drafts on WINDOW positions, then none on GAP


class ScriptedDrafter(OracleDrafter):
    """Proposes the recorded continuation `reference` where `drafts_at(position)` says so, else
    nothing (an empty draft, as the n-gram drafter gives on text it has not seen)."""

    def __init__(self, reference: list[int], prompt_len: int, drafts_at):
        super().__init__(reference, prompt_len)
        self.drafts_at = drafts_at

    def propose(self, context, max_tokens):
        start = len(context) - self.prompt_len  # the context ends with the pending token
        if self.drafts_at(start):
            return super().propose(context, min(max_tokens, WINDOW))
        from ngram.draft import Draft
        return Draft(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32), "scripted", 0)


WORKLOADS = {
    "drought": lambda position: False,
    "mixed": lambda position: position % (WINDOW + GAP) < WINDOW,
    "drafted": lambda position: True,
}


def _tiny_engine():
    """A tiny random Gemma 4 on the CPU, served by an uncaptured fast path that says it chains."""
    import torch

    from bench.step_ab import _tiny_gemma4
    from server.engine import Engine, EngineConfig
    from server.fast_path import FastTarget
    from server.model_loading import LoadedTarget

    class SaysItChains(FastTarget):
        chains_steps = True

    model = _tiny_gemma4()
    backend = SaysItChains(model, max_len=2048, prefill_chunk=64, capture=False, min_kv_len=16)
    target = LoadedTarget(model, IdTokenizer(), "tiny", "none", torch.float32, torch.device("cpu"), [])
    return Engine(target, None, EngineConfig(adaptive=False, cpu_int8=False, launch_early=True), backend=backend)


def _e4b_engine(gen: int):
    from bench.gpu_e4b import build_model, random_e4b_target
    from server.engine import Engine, EngineConfig

    return Engine(random_e4b_target(build_model(quant=True)), None, EngineConfig(fast_max_context=4096 + 2 * gen))


def measure(engine, gen: int, rounds: int) -> dict:
    from server import engine as engine_module

    shipped = engine_module.DROUGHT_STEPS
    vocab = engine.vocab_size
    prompt = [2] + np.random.default_rng(0).integers(3, vocab, PROMPT - 1).tolist()
    engine.set_drafter(None)
    engine_run(engine, prompt, 8, False)   # warm: graphs, the first chained decode
    plain, stats = engine_run(engine, prompt, gen, False)
    results = {"gen": gen, "rounds": rounds, "shipped": shipped, "plain_no_drafter_tps": stats.tokens_per_s,
               "workloads": {}}
    for name, drafts_at in WORKLOADS.items():
        engine.set_drafter(ScriptedDrafter(plain, len(prompt), drafts_at))
        runs = {"off": [], "on": []}
        for r in range(rounds):
            for setting in (("off", "on") if r % 2 == 0 else ("on", "off")):  # turns at going first
                engine_module.DROUGHT_STEPS = None if setting == "off" else shipped
                try:
                    out, st = engine_run(engine, prompt, gen, True)
                finally:
                    engine_module.DROUGHT_STEPS = shipped
                if out != plain:
                    raise AssertionError(f"{name}, rule {setting}: the output differs from plain decoding")
                runs[setting].append({"tps": st.tokens_per_s, "plain_steps": st.plain_steps,
                                      "verify_steps": st.verify_steps, "chained": st.chained_steps})
        results["workloads"][name] = runs
    engine.set_drafter(None)
    return results


def _summary(samples: list[dict], key: str) -> str:
    values = [s[key] for s in samples]
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def markdown(res: dict, command: str, device: str) -> str:
    lines = [f"# The drought rule: a drafting request's plain steps chained on the device ({device})", "",
             f"Command: `{command}`. One process; {res['rounds']} rounds, the rule off (DROUGHT_STEPS=None) "
             f"and on (DROUGHT_STEPS={res['shipped']}) alternating, taking turns at going first; {res['gen']} "
             f"tokens a request after a {PROMPT}-token prompt, greedy; every output equal to plain decoding "
             f"(checked). Plain decoding with no drafter (chained as before): "
             f"{res['plain_no_drafter_tps']:.1f} tokens/s.", "",
             "| workload | off, tokens/s | on, tokens/s | on / off | plain + verify steps (off / on) | chained steps (on) |",
             "|---|---|---|---|---|---|"]
    for name, runs in res["workloads"].items():
        off, on = runs["off"], runs["on"]
        ratio = statistics.median(s["tps"] for s in on) / statistics.median(s["tps"] for s in off)
        steps = (f"{off[-1]['plain_steps']} + {off[-1]['verify_steps']} / "
                 f"{on[-1]['plain_steps']} + {on[-1]['verify_steps']}")
        lines.append(f"| {name} | {_summary(off, 'tps')} | {_summary(on, 'tps')} | {ratio:.3f}x | {steps} | "
                     f"{on[-1]['chained']} |")
    lines += ["", f"Workloads: drought (no drafts at all), mixed (drafts of the true continuation on {WINDOW} "
              f"positions in every {WINDOW + GAP}), drafted (drafts everywhere)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    from bench.results import write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the harness only")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.gen < 2:
        ap.error("--rounds must be at least 1 and --gen at least 2")
    if args.tiny:
        engine, device = _tiny_engine(), "CPU, tiny model: times mean nothing"
    else:
        import torch
        engine, device = _e4b_engine(args.gen), torch.cuda.get_device_name()
    res = measure(engine, args.gen, args.rounds)
    command = "python -m bench.drought_ab " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(res, command.strip(), device)
    print(md)
    write_results(args.out, "drought_ab" + ("-tiny" if args.tiny else ""), {"device": device, **res}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
