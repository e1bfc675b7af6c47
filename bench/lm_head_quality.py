"""What the int8 LM head costs in output quality, on a real Gemma: the bundled Gemma 3 270M (CPU).

The GPU fast path's `--lm-head int8` (auto under `--gpu-memory-mb`; server/fast_path.py
`FastTarget._int8_head`) replaces the bf16 head with server.small_m_matmul.quantize_int8's (a
scale per 128 input features and output column). No Gemma 4 weights can be had here, and random
weights say nothing about quality, so this measures the same quantization on the one real Gemma
at hand, which has the same 262,144-token vocabulary (its head: 262,144 x 640). Each head's logits
are computed from the same final hidden states (transformers' forward, fp32) against the bf16
head's: how often the greedy token is the same, the mean KL divergence from the bf16 head's
distribution, and the perplexity of the text itself. Two texts: prose and code (this project's
README) and agent traces (the Claude Code fixture's JSON lines). Other heads for scale: int8 with
one scale per row, and int4 with a scale and offset per 128 features (which the server does not use).

Usage: python -m bench.lm_head_quality [--tokens 2000] [--out DIR]
Writes DIR/lm_head_quality.json and .md (default bench/results/). About 2 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from bench.results import write_results
from server.small_m_matmul import BLOCK_K, quantize_int8

ROOT = Path(__file__).resolve().parents[1]
TEXTS = {"README (prose, code)": ROOT / "README.md",
         "agent traces (JSON lines)": ROOT / "tests/fixtures/claude_code_short.jsonl"}


def int8_per_row(w: torch.Tensor) -> torch.Tensor:
    s = (w.float().abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
    return ((w.float() / s).round().clamp(-127, 127) * s).to(w.dtype)


def int4_groups(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    g = w.float().view(n, k // BLOCK_K, BLOCK_K)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    return (((g - lo) / scale).round().clamp(0, 15) * scale + lo).view(n, k).to(w.dtype)


def heads_of(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    bf16 = weight.detach().to(torch.bfloat16)
    return {"bf16 (reference)": bf16,
            "int8, scale per 128 features (the server's)": quantize_int8(bf16).dequantize(),
            "int8, scale per row": int8_per_row(bf16),
            "int4, scale and offset per 128 features (not used)": int4_groups(bf16)}


def final_hidden(lm, ids: torch.Tensor, window: int = 1024) -> torch.Tensor:
    """The LM head's input for every position, in windows of `window` tokens (a fresh context each)."""
    seen = []
    hook = lm.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0][0].detach().float()))
    try:
        with torch.no_grad():
            for s in range(0, len(ids), window):
                lm(ids[None, s:s + window])
    finally:
        hook.remove()
    return torch.cat(seen)


def compare(x: torch.Tensor, targets: torch.Tensor, heads: dict, softcap: float | None, rows: int = 250) -> dict:
    """Per head: greedy agreement with the first head, mean KL(first || head), perplexity of `targets`."""
    sums = {name: [0.0, 0.0, 0.0] for name in heads}
    ref_name = next(iter(heads))
    for s in range(0, len(targets), rows):
        xc, tc = x[s:s + rows], targets[s:s + rows]
        logp = {}
        for name, w in heads.items():
            logits = xc @ w.float().t()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            logp[name] = logits.log_softmax(-1)
        ref = logp[ref_name]
        for name, lp in logp.items():
            acc = sums[name]
            acc[0] += (lp.argmax(-1) == ref.argmax(-1)).sum().item()
            acc[1] += (ref.exp() * (ref - lp)).sum(-1).sum().item()
            acc[2] -= lp.gather(1, tc[:, None]).sum().item()
    n = len(targets)
    return {name: {"greedy_agree": a / n, "kl": k / n, "perplexity": math.exp(nll / n)}
            for name, (a, k, nll) in sums.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lm_head_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000, help="tokens of each text")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    from server.model_loading import load_target

    target = load_target(device="cpu", quant="none", dtype=torch.float32)
    lm, tok = target.model, target.tokenizer
    heads = heads_of(lm.lm_head.weight)
    softcap = getattr(lm.config, "final_logit_softcapping", None)
    results = {"model": target.model_id, "head_shape": list(lm.lm_head.weight.shape), "texts": {}}
    for label, path in TEXTS.items():
        ids = tok(path.read_text(), return_tensors="pt").input_ids[0][:args.tokens + 1]
        x = final_hidden(lm, ids[:-1])
        results["texts"][label] = {"tokens": len(ids) - 1, "heads": compare(x, ids[1:], heads, softcap)}
        print(label, results["texts"][label], flush=True)
    write_results(Path(args.out), "lm_head_quality", results, markdown(results))
    print(markdown(results))
    return 0


def markdown(r: dict) -> str:
    lines = ["# The int8 LM head's cost in quality (bundled Gemma 3 270M, CPU)", "",
             f"Model {r['model']}, head {r['head_shape'][0]} x {r['head_shape'][1]}. Every head's logits from the same "
             "final hidden states (transformers, fp32), against the bf16 head's. Command: `python -m bench.lm_head_quality`.",
             "", "| text | head | greedy token as bf16's | mean KL from bf16 | perplexity |", "|---|---|---|---|---|"]
    for label, t in r["texts"].items():
        for name, h in t["heads"].items():
            lines.append(f"| {label} ({t['tokens']} tokens) | {name} | {100 * h['greedy_agree']:.2f}% | "
                         f"{h['kl']:.5f} | {h['perplexity']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
