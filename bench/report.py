"""Tables and charts for `make bench`, made only from the results JSON (nothing typed in by hand)."""
from __future__ import annotations

from pathlib import Path

NAMES = {
    "sailfish_plain": "Sailfish plain", "sailfish_drafted": "Sailfish drafted", "suffix_decoding": "SuffixDecoding (Sailfish loop)",
    "hf_prompt_lookup": "transformers prompt lookup", "llamacpp_plain": "llama.cpp plain",
    "llamacpp_prompt_lookup": "llama.cpp prompt lookup",
}


def _s(d: dict | None, fmt: str = "{:.2f}") -> str:
    if not d or d.get("median") is None:
        return "-"
    return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}..{fmt.format(d['max'])})"


def _sampled_lines(r: dict) -> list[str]:
    lines: list[str] = []
    if r.get("sampled"):
        lines += ["", "Sampled decoding, drafted vs plain with the same seed per request (decode tok/s, "
                  "median [min-max] of per-request speed-ups):", "",
                  "| preset | workload | plain tok/s | drafted tok/s | speed-up | acceptance | identical |",
                  "|---|---|---|---|---|---|---|"]
        for preset, per in r["sampled"].items():
            for name, w in per.items():
                sp = w["speedup"]
                lines.append(f"| {preset} | {name} | {_s(w['plain_tok_s'])} | {_s(w['drafted_tok_s'])} | "
                             f"{sp['median']:.2f}x [{sp['min']:.2f}-{sp['max']:.2f}] | {w['acceptance_rate']:.2f} | "
                             f"{'yes' if w['identical'] else 'NO'} ({w['requests']}) |")
    return lines


def _backend(r: dict) -> str:
    """Which forward the figures ran on (results before the int8 path was the default: fp32 eager)."""
    return {"CpuBackend": "the int8 path"}.get(r.get("backend", "EagerBackend"), "transformers fp32")


def sampled_markdown(r: dict) -> str:
    """`python -m bench --sampled-only`: the sampled-decoding table alone."""
    head = (f"Mode `{r['mode']}`, {r['config']['requests']} requests per workload, max_tokens "
            f"{r['config']['max_tokens']}; bundled Gemma 3 270M, CPU, {_backend(r)}; run took {r['seconds'] / 60:.1f} min.")
    return "\n".join([head, *_sampled_lines(r)]) + "\n"


def markdown(r: dict) -> str:
    lines = [f"Mode `{r['mode']}`, workloads v{r['workload_version']}, {r['config']['requests']} requests per workload, "
             f"{r['config']['max_tokens']} new tokens, prompts cut to their last {r['config']['max_prompt']} tokens; "
             f"bundled Gemma 3 270M (base), CPU, {_backend(r)}. Index: {r['index']['tokens']:,} tokens. Run took {r['seconds'] / 60:.1f} min.",
             "", "Decode tokens/s, median (min..max) over requests; speed-up = per-request ratio to Sailfish plain:", "",
             "| workload | contender | tokens/s | speed-up | identical to plain |", "|---|---|---|---|---|"]
    for name, w in r["workloads"].items():
        for key, sp in w["tok_s"].items():
            speed = w["speedup_vs_plain"].get(key)
            if key.startswith("llamacpp"):
                speed = w.get("llamacpp_speedup_vs_own_plain") if key == "llamacpp_prompt_lookup" else None
            ident = w["identical"].get(key, "")
            n = len(w["requests"])
            lines.append(f"| {name} | {NAMES[key]} | {_s(sp)} | {_s(speed) + 'x' if speed else ('1x' if key == 'sailfish_plain' else '-')} | "
                         f"{f'{ident}/{n}' if ident != '' else ''} |")
    lines += ["", "llama.cpp's speed-up is over its own plain decoding (another engine).", "",
              "Drafting overhead (drafter time / (drafter + forward) per request, %), acceptance, and how much of the plain "
              "output copies or loops (share of tokens ending a 6-gram seen before):", "",
              "| workload | overhead % | acceptance | verify steps | loop rate |", "|---|---|---|---|---|"]
    for name, w in r["workloads"].items():
        lines.append(f"| {name} | {_s(w['overhead_per_verify_step_pct'])} | {w['acceptance']:.2f} | {w['verify_steps']} | {_s(w['loop_rate'])} |")
    lines += _sampled_lines(r)
    lines += ["", "Offline replay of the plain outputs (ngram.replay): tau / acceptance / draft p50 us / p99 us:", "",
              "| workload | Sailfish | Sailfish, context only | prompt lookup | SuffixDecoding |", "|---|---|---|---|---|"]
    for name, rep in r["replay"].items():
        cells = [f"{d['tau']:.2f} / {d['acceptance_rate']:.2f} / {d['draft_us_p50']:.0f} / {d['draft_us_p99']:.0f}"
                 for d in (rep["sailfish"], rep["sailfish_context_only"], rep["prompt_lookup"], rep["suffix_decoding"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    m = r["matrix"]
    b = m["best_realistic"]
    lines += ["", f"Matrix ({len(m['cells'])} cells; tokens/s projected from replay and the measured verify cost curve). "
              f"Best realistic cell: max draft {b['max_draft']}, min match {b['min_match']}, cut-off {b['cutoff']}: "
              f"tau {b['tau']:.2f}, {b['projected_tok_s']:.1f} tok/s projected. Chart: matrix heat map.", "",
              "Verify cost curve (forward time for n new tokens / 1): " + " ".join(f"{i + 1}:{c:.2f}" for i, c in enumerate(r["cost_curve"])),
              "", "| context | prefill tok/s | decode plain | decode drafted | identical |", "|---|---|---|---|---|"]
    for c in r["long_context"]:
        lines.append(f"| {c['context']:,} | {c['prefill_tok_s']:.0f} | {c['decode_tok_s_plain']:.2f} | {c['decode_tok_s_drafted']:.2f} | {c['identical']} |")
    if r["concurrency"]:
        lines += ["", "| concurrent streams | throughput tok/s | identical to solo |", "|---|---|---|"]
    for n, c in r["concurrency"].items():
        lines.append(f"| {n} | {c['throughput_tok_s']:.2f} | {c['identical_to_solo']} |")
    return "\n".join(lines) + "\n"


def charts(r: dict, out: Path, stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    workloads = list(r["workloads"])
    keys = [k for k in NAMES if k in next(iter(r["workloads"].values()))["tok_s"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(keys)
    for i, k in enumerate(keys):
        med = [r["workloads"][w]["tok_s"][k]["median"] or 0 for w in workloads]
        lo = [m - (r["workloads"][w]["tok_s"][k]["min"] or 0) for m, w in zip(med, workloads)]
        hi = [(r["workloads"][w]["tok_s"][k]["max"] or 0) - m for m, w in zip(med, workloads)]
        ax.bar(np.arange(len(workloads)) + i * width, med, width, yerr=[lo, hi], label=NAMES[k], capsize=2)
    ax.set_xticks(np.arange(len(workloads)) + width * (len(keys) - 1) / 2, workloads)
    ax.set_ylabel("decode tokens/s (median, min..max)")
    ax.set_title("Tokens/s by contender and workload (Gemma 3 270M, CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}-tokens.png", dpi=110)
    plt.close(fig)

    drafters = ["sailfish", "sailfish_context_only", "prompt_lookup", "suffix_decoding"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(drafters)
    for i, d in enumerate(drafters):
        ax.bar(np.arange(len(workloads)) + i * width, [r["replay"][w][d]["tau"] for w in workloads], width, label=d)
    ax.set_xticks(np.arange(len(workloads)) + width * (len(drafters) - 1) / 2, workloads)
    ax.set_ylabel("tau (tokens per verify step)")
    ax.set_title("Replay tau by drafter")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}-tau.png", dpi=110)
    plt.close(fig)

    cells = [c for c in r["matrix"]["cells"] if c["set"] == "realistic"]
    drafts = sorted({c["max_draft"] for c in cells})
    rows = sorted({(c["min_match"], c["cutoff"]) for c in cells})
    grid = np.array([[max(c["projected_tok_s"] for c in cells if c["max_draft"] == k and (c["min_match"], c["cutoff"]) == row)
                      for k in drafts] for row in rows])
    fig, ax = plt.subplots(figsize=(6, 0.35 * len(rows) + 1.5))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(drafts)), [str(k) for k in drafts])
    ax.set_yticks(range(len(rows)), [f"match {m}, cut {c}" for m, c in rows])
    ax.set_xlabel("max draft")
    for i in range(len(rows)):
        for j in range(len(drafts)):
            ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=7, color="w")
    fig.colorbar(im, label="projected tokens/s")
    ax.set_title("Matrix, realistic prompts")
    fig.tight_layout()
    fig.savefig(out / f"{stem}-matrix.png", dpi=110)
    plt.close(fig)
