"""A/B of the fast path's step between two versions of the code, side by side in one run.

    python -m bench.step_ab [--base REV] [--rounds 2] [--reps 200] [--out DIR]     (GPU machine)
    python -m bench.step_ab --tiny --rounds 1                                       (any machine: a smoke run)
    python -m bench.step_ab --base-tree . --base HEAD --base-set server.fast_path.SUMMED_SLICES=False \
        --head-set server.fast_path.SUMMED_SLICES=True                            (one switch, on against off)

Contract: the version at git revision `--base` (default HEAD, i.e. the last commit, against the
working tree's changes) is exported to a temporary folder (`git archive`), and each round runs one
measuring process on it and one on this checkout, alternately (base, head, base, head ...), so
that a slow spell of the machine hits both. Each process imports the server code of its own tree
and runs the same measurement (this file's `measure`): the E4B shape (random init, quanto int4, the
per-layer table on the host, as bench.gpu_e4b builds it) on a FastTarget with the step kernels and
CUDA graphs, a 1,000-token prompt, then
  - a one-token step and a 16-token verify: the median of `--reps` timed calls (each ends in a
    device-to-host copy of an argmax), five times over; the figure is the median of the five;
  - the kernels one captured one-token step launches (torch.profiler, CUDA activity);
  - plain greedy decode of 256 tokens at 1k context (tokens/s of the 255 one-token steps after the
    prefill's token, timed from that token on the host; after an untimed first decode, which
    captures the graphs of positions past 1,024), the same decode with each step launched from the
    argmax the step before left on the device (`step_after_argmax`, as the engine runs plain
    greedy requests; where the version has it: the same tokens, checked), the two alternating,
    DECODES of each (their medians), and drafted
    decode with oracle drafts (20% of tokens wrong): drafted equals plain, token for token.
`--rows N [N ...]`: steps of N tokens more (up to 64: the buckets of several lanes' drafts in one
forward, server/fast_batch.py), timed as the verify is, each version's N-token logits hashed: the
table says whether the two versions computed the same bits at each N.
`--base-set` / `--head-set MODULE.NAME=VALUE` (repeatable): a module-level setting of that version's
code set before it measures (VALUE a Python literal of the type the setting has or is annotated
with, `int | None` say; a name the module lacks is refused), so one
switch (the fast path's A/B flags) is compared within one tree, `--base-tree .`. Writes
DIR/step_ab.json and step_ab.md (default bench/results/): per version, the median over rounds and
the range, and the settings each ran with. `--tiny` measures a tiny random Gemma 4 on the CPU instead (no graphs, no
kernel count): it checks the harness, and its times mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT, GEN, VERIFY = 1000, 256, 16
DECODES = 3   # plain decodes of GEN tokens a measurement: step by step and chained, alternating


def measure(tiny: bool, reps: int, rows: tuple[int, ...] = ()) -> dict:
    """One version's figures (imports the server code of the tree it runs in); `rows`: more step sizes."""
    import hashlib

    import torch

    from bench.fast_greedy import greedy_generate, oracle
    from server.fast_path import FastTarget

    cuda = not tiny
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    buckets = tuple(sorted({2, VERIFY, *rows}))
    if tiny:
        model = _tiny_gemma4()
        fast = FastTarget(model, max_len=PROMPT + GEN + 64, buckets=buckets)
    else:
        from bench.gpu_e4b import build_model

        model = build_model(quant=True)
        model.model.embed_tokens_per_layer.to("cpu")
        torch.cuda.empty_cache()
        fast = FastTarget(model, max_len=PROMPT + GEN + 64, buckets=buckets, min_kv_len=1024, ple_on_host=True)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (PROMPT,), generator=g).tolist()
    fast.prefill(prompt)

    def timed(ids: list[int], n: int) -> float:
        xs = []
        for _ in range(n):
            sync()
            t = time.perf_counter()
            fast.step(ids)[0].argmax().item()
            xs.append(time.perf_counter() - t)
            fast.rollback(len(ids))
        return statistics.median(xs) * 1e3

    one, verify = [5], list(range(5, 5 + VERIFY))
    for _ in range(3):  # warm-up (graphs, caches, clocks)
        timed(one, 20), timed(verify, 20)
    more = {n: list(range(5, 5 + n)) for n in rows}
    for ids in more.values():  # their graphs captured, untimed
        timed(ids, 20)
    step1, step16, step_more = [], [], {n: [] for n in rows}
    for _ in range(5):
        step1.append(timed(one, reps))
        step16.append(timed(verify, reps))
        for n, ids in more.items():
            step_more[n].append(timed(ids, reps))
    logits_sha = {}
    for n, ids in more.items():  # the step's logits, every row, as bytes: the same code path gives the same hash
        logits_sha[str(n)] = hashlib.sha256(fast.step(ids).float().cpu().numpy().tobytes()).hexdigest()[:16]
        fast.rollback(n)
    kernels, kernel_names, timeline = None, {}, {}
    if cuda:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fast.step(one)[0].argmax().item()
        fast.rollback(1)
        launched = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = sum(e.count for e in launched)
        counts: dict[str, int] = {}
        for e in launched:  # names cut to 90 characters: kernels of one template can share one
            counts[e.key[:90]] = counts.get(e.key[:90], 0) + e.count
        kernel_names = dict(sorted(counts.items(), key=lambda kv: -kv[1])[:24])
        timeline = {"one": step_timeline(fast, one), "verify": step_timeline(fast, verify)}
    # A first decode captures the graphs that later positions need (kv_len past 1024): not timed.
    greedy_generate(fast, prompt, GEN)
    # timed from the prefill's token on the host to the last one: the decode alone (timing a prefill
    # apart and subtracting it carried that prefill's own spread into the figure). greedy_generate's
    # plain loop, spelled out with the calls every version measured has (fast.start, fast.step).
    from server.sampling import row_argmax

    def decode_step_by_step() -> tuple[list[int], float]:
        out = [int(fast.start(prompt).logits.argmax())]
        t0 = time.perf_counter()
        while len(out) < GEN:
            out.append(row_argmax(fast.step([out[-1]]))[0])
        sync()
        return out, time.perf_counter() - t0

    # The same decode as the engine runs plain greedy requests where the code has it: each step
    # launched from the argmax the step before left on the device, before the host reads it
    # (server/fast_path.py step_after_argmax); timed to the last token read, the step launched after
    # it rolled back.
    def decode_chained() -> tuple[list[int], float]:
        out = [int(fast.start(prompt).logits.argmax())]
        t0 = time.perf_counter()
        logits = fast.step(out[-1:])
        while len(out) < GEN:
            token, logits = fast.step_after_argmax(logits)
            out.append(token)
        seconds = time.perf_counter() - t0
        sync()
        fast.rollback(1)
        return out, seconds

    # DECODES of each, the two alternating and taking turns at going first; the median of each
    kinds = {"plain": decode_step_by_step}
    if getattr(fast, "chains_steps", False):
        kinds["chained"] = decode_chained
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    tokens: dict[str, list[int]] = {}
    for i in range(DECODES):
        for kind in (list(kinds) if i % 2 == 0 else list(kinds)[::-1]):
            tokens[kind], took = kinds[kind]()
            seconds[kind].append(took)
        if tokens.get("chained", tokens["plain"]) != tokens["plain"]:
            raise AssertionError("chained plain decoding left the step-by-step tokens")
    plain = tokens["plain"]
    decode_s = statistics.median(seconds["plain"])
    chained_s = statistics.median(seconds["chained"]) if "chained" in seconds else None
    drafted, steps = greedy_generate(fast, prompt, GEN, oracle(plain, len(prompt), vocab=vocab))
    return {"step1_ms": statistics.median(step1), "step16_ms": statistics.median(step16),
            **{f"step{n}_ms": statistics.median(v) for n, v in step_more.items()}, "rows_logits_sha": logits_sha,
            "kernels_per_step": kernels, "kernel_names": kernel_names, "timeline": timeline,
            "plain_tps_1k": (GEN - 1) / decode_s,  # the tokens of the steps after the prefill's
            "chained_tps_1k": (GEN - 1) / chained_s if chained_s else None,
            "drafted_equals_plain": drafted == plain, "drafted_steps": steps}


HOST_GAP_US = 20  # a gap between kernels this long is the host's (staging, the graph's launch): not the step's


def step_timeline(fast, ids: list[int], steps: int = 20) -> dict:
    """Where a step's GPU time goes: all a `fast.step(ids)` and its argmax put on the GPU (the
    staging copies, the captured graph's kernels, the argmax and its copy back), its span (first
    start to last end, ms a step, less the gaps of HOST_GAP_US or more) cut into pieces that do not
    overlap, each charged to one kernel name, or to "(idle)" where none ran. Kernels overlap under
    programmatic dependent launch (a kernel starts while the one before it runs, then waits), so a
    kernel is charged only from the later of its start and the previous kernel's end: the pieces add
    up to the span. Mean over `steps` steps."""
    import torch

    from bench.kernel_time import charge, cuda_kernels

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fast.step(ids)[0].argmax().item()
            fast.rollback(len(ids))
    charged = charge(cuda_kernels(prof), HOST_GAP_US)
    us_per_ms = 1e3 * steps
    return {name: round(t / us_per_ms, 4) for name, t in charged.items()}


def _tiny_gemma4():
    import torch
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    torch.manual_seed(0)
    cfg = Gemma4TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                           num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                           sliding_window=8, max_position_embeddings=4096,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    model = Gemma4ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def parse_settings(settings: list[str]) -> list[tuple[str, str, object]]:
    """(module, name, value) of each `MODULE.NAME=VALUE`, checked against this process's modules:
    VALUE a Python literal of the type the setting has (an int where it is a float), the module
    one of the code's (not this harness: a child measures in its own copy of it). A ValueError
    names the setting otherwise."""
    import ast
    import importlib

    parsed = []
    for setting in settings:
        target, sep, text = setting.partition("=")
        module_name, _, name = target.rpartition(".")
        if not sep or not module_name or not name:
            raise ValueError(f"a setting is MODULE.NAME=VALUE, not {setting!r}")
        if module_name in (__name__, "bench.step_ab", "__main__"):
            raise ValueError(f"{setting!r}: the harness's own settings are not settable (its children measure "
                             "in a copy of it)")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"{setting!r}: the value is not a Python literal ({e})") from None
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"{setting!r}: no module {module_name} ({e})") from None
        if not hasattr(module, name):
            raise ValueError(f"{setting!r}: {module_name} has no {name} to set")
        current = getattr(module, name)
        if not _fits(value, current, _annotation(module, name)):
            raise ValueError(f"{setting!r}: {module_name}.{name} is a {type(current).__name__}, "
                             f"not a {type(value).__name__}")
        parsed.append((module_name, name, value))
    return parsed


def _annotation(module, name: str):
    """The type `name` is annotated with in `module` (evaluated), or None."""
    import typing

    try:
        return typing.get_type_hints(module).get(name)
    except Exception:  # an annotation that does not evaluate: the current value's type decides
        return None


def _fits(value, current, annotation) -> bool:
    """Whether `value` may replace a setting whose value is `current`: of its type, or of the type it is
    annotated with (`int | None` takes None); an int where a float is. A bool is no int here."""
    import typing

    if type(value) is type(current) or (isinstance(current, float) and type(value) is int):
        return True
    if annotation is None or isinstance(value, bool) != (annotation is bool or bool in typing.get_args(annotation)):
        return False
    try:
        return isinstance(value, annotation)
    except TypeError:   # an annotation isinstance cannot take (a generic alias)
        return False


def apply_settings(settings: list[str]) -> dict:
    """Each `MODULE.NAME=VALUE` (`parse_settings`) set on its module; returns {"MODULE.NAME": value}."""
    import importlib

    applied = {}
    for module_name, name, value in parse_settings(settings):
        setattr(importlib.import_module(module_name), name, value)
        applied[f"{module_name}.{name}"] = value
    return applied


def run_version(tree: Path, tiny: bool, reps: int, settings: list[str] = (), rows: list[int] = ()) -> dict:
    """`measure` in a fresh process whose imports come from `tree`, with `settings` applied first."""
    # The tree first; what the caller's PYTHONPATH adds (packages installed beside the system's) after it.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != "."]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + extra), PYTHONUNBUFFERED="1")
    cmd = ([sys.executable, str(Path(__file__).resolve()), "--measure", "--reps", str(reps)] + (["--tiny"] if tiny else [])
           + (["--rows", *map(str, rows)] if rows else [])
           + [arg for setting in settings for arg in ("--head-set", setting)])
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"measuring {tree} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def export(rev: str, into: Path) -> str:
    """The tree of `rev` written into `into`; returns its full commit id."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def summarize(samples: list[dict]) -> dict:
    out = {}
    rows = samples[0].get("rows_logits_sha", {})   # --rows: a step{n}_ms figure each
    for key in ("step1_ms", "step16_ms", *(f"step{n}_ms" for n in rows), "plain_tps_1k", "chained_tps_1k",
                "kernels_per_step"):
        vals = [s[key] for s in samples if s.get(key) is not None]
        if vals:
            out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    out["rows_logits_sha"] = {n: sorted({s["rows_logits_sha"][n] for s in samples}) for n in rows}
    out["drafted_equals_plain"] = all(s["drafted_equals_plain"] for s in samples)
    return out


def markdown(r: dict) -> str:
    b, h = r["versions"]["base"], r["versions"]["head"]
    f = lambda x, key, d=2: (f"{x[key]['median']:.{d}f} ({x[key]['min']:.{d}f}-{x[key]['max']:.{d}f})"
                             if key in x else "-")
    ratio = lambda key: (f"{h[key]['median'] / b[key]['median']:.3f}x" if key in b and key in h else "-")
    lines = [
        "# Fast-path step A/B: two versions of the code, side by side",
        "",
        f"{r['when']}, {r['machine']}, {r['device']}. Command: `{r['command']}`. base = {r['base']}, head = "
        f"{r['head']}. {r['rounds']} rounds, alternating base and head; median over rounds (range)."
        + "".join(f" {v} sets {', '.join(f'`{x}`' for x in r['settings'][v])}." for v in ("base", "head")
                  if r.get("settings", {}).get(v)),
        "",
        "| | base | head | head / base |",
        "|---|---|---|---|",
        f"| one-token step, ms | {f(b, 'step1_ms')} | {f(h, 'step1_ms')} | {ratio('step1_ms')} |",
        f"| {VERIFY}-token verify, ms | {f(b, 'step16_ms')} | {f(h, 'step16_ms')} | {ratio('step16_ms')} |",
        *(f"| {n}-token step, ms | {f(b, f'step{n}_ms')} | {f(h, f'step{n}_ms')} | {ratio(f'step{n}_ms')} |"
          for n in h.get("rows_logits_sha", {})),
        *(f"| {n}-token step's logits, the same bits in both | {b['rows_logits_sha'].get(n) == h['rows_logits_sha'][n]} "
          "| | |" for n in h.get("rows_logits_sha", {})),
        f"| kernels per one-token step | {f(b, 'kernels_per_step', 0)} | {f(h, 'kernels_per_step', 0)} | "
        f"{ratio('kernels_per_step')} |",
        f"| plain decode at 1k, tokens/s | {f(b, 'plain_tps_1k', 1)} | {f(h, 'plain_tps_1k', 1)} | "
        f"{ratio('plain_tps_1k')} |",
        f"| plain decode at 1k, steps chained on the device (the engine's), tokens/s | {f(b, 'chained_tps_1k', 1)} | "
        f"{f(h, 'chained_tps_1k', 1)} | {ratio('chained_tps_1k')} |",
        f"| drafted equals plain ({GEN} tokens) | {b['drafted_equals_plain']} | {h['drafted_equals_plain']} | |",
        "",
    ]
    names = {v: (r["samples"][v][-1].get("kernel_names") or {}) for v in ("base", "head")}
    if names["head"] or names["base"]:
        lines += ["Kernels one one-token step launches, by name (the most launched; last round):", "",
                  "| kernel | base | head |", "|---|---|---|"]
        for key in dict.fromkeys([*names["head"], *names["base"]]):
            lines.append(f"| `{key}` | {names['base'].get(key, '-')} | {names['head'].get(key, '-')} |")
        lines.append("")
    spans = {v: (r["samples"][v][-1].get("timeline") or {}) for v in ("base", "head")}
    for kind, label in (("one", "one-token step"), ("verify", f"{VERIFY}-token verify")):
        times = {v: spans[v].get(kind) or {} for v in spans}
        if not (times["base"] or times["head"]):
            continue
        lines += [f"Where a {label}'s GPU time goes, ms a step (last round; a kernel is charged from the later of "
                  "its start and the previous kernel's end, so overlapping launches are not counted twice; gaps of "
                  f"{HOST_GAP_US} us or more, the host's, are left out of the span):",
                  "", "| kernel | base | head |", "|---|---|---|",
                  f"| (span) | {sum(times['base'].values()):.3f} | {sum(times['head'].values()):.3f} |"]
        # the kernels that take the most time on either side (one side's alone would hide what the other
        # ran instead)
        keys = sorted({*times["head"], *times["base"]},
                      key=lambda k: -max(times["base"].get(k, 0.0), times["head"].get(k, 0.0)))
        for key in keys[:16]:
            cell = lambda v: f"{times[v][key]:.3f}" if key in times[v] else "-"
            lines.append(f"| `{key}` | {cell('base')} | {cell('head')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare this checkout with")
    ap.add_argument("--base-tree", default=None,
                    help="a folder holding the base version's tree, exported beforehand (`git archive REV | tar -x -C DIR`), "
                         "for a machine whose copy of the checkout has no git history; --base then only names it")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200, help="timed calls per figure")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the harness only")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--base-set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="a module-level setting of the base version's code, set before it measures (repeatable)")
    ap.add_argument("--head-set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="the same for this checkout's version")
    ap.add_argument("--rows", type=int, nargs="+", default=[], metavar="N",
                    help="step sizes timed besides 1 and 16 (up to 64), their logits compared between the versions")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args(argv)
    if any(not 2 <= n <= 64 for n in args.rows):
        ap.error(f"--rows takes step sizes from 2 to 64, not {args.rows}")
    if args.measure:   # a child: its settings come as --head-set
        applied = apply_settings(args.head_set)
        print(json.dumps({**measure(args.tiny, args.reps, tuple(args.rows)), "settings": applied}), flush=True)
        return 0
    from bench.results import write_results

    # Refused now, not a round later: every setting against this checkout's code (the base tree's
    # too where it is this checkout; another tree's child checks its own names again)
    base_is_here = args.base_tree is not None and Path(args.base_tree).resolve() == ROOT
    parse_settings(args.head_set + (args.base_set if base_is_here else []))
    if not base_is_here:
        for setting in args.base_set:
            if "=" not in setting:
                raise ValueError(f"a setting is MODULE.NAME=VALUE, not {setting!r}")
    device = "CPU (tiny model)" if args.tiny else _gpu_name()
    samples: dict[str, list] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="sailfish-ab-") as tmp:
        if args.base_tree:
            base_tree, base_commit = Path(args.base_tree).resolve(), args.base
        else:
            base_tree, base_commit = Path(tmp), export(args.base, Path(tmp))
        for r in range(args.rounds):
            for name, tree, settings in (("base", base_tree, args.base_set), ("head", ROOT, args.head_set)):
                samples[name].append(run_version(tree, args.tiny, args.reps, settings, args.rows))
                print(f"round {r + 1} {name}: {samples[name][-1]}", file=sys.stderr, flush=True)
    results = {"command": "python -m bench.step_ab" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
               "device": device, "base": f"{args.base} ({base_commit[:12]})", "head": "this checkout",
               "rounds": args.rounds, "samples": samples, "settings": {"base": args.base_set, "head": args.head_set},
               "versions": {k: summarize(v) for k, v in samples.items()}}
    from bench.results import run_header

    md = markdown({**run_header(), **results})
    write_results(args.out, "step_ab" + ("-tiny" if args.tiny else ""), results, md)
    print(md)
    return 0 if all(v["drafted_equals_plain"] for v in results["versions"].values()) else 1


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


if __name__ == "__main__":
    sys.exit(main())
