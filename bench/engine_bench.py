"""Engine benchmark: drafted vs plain decoding vs transformers' prompt lookup, same prompts, same run.

Usage:
  python -m bench.engine_bench [--requests 8] [--max-tokens 64] [--index PATH]
      Bundled Gemma 3 270M on CPU (fp32). Workloads: tool calls (BFCL held-out conversations) and
      reasoning prose (bench.workloads). Prints, per workload, median decode tokens/s with the
      min..max spread for plain decoding, Sailfish drafting (ngram.NgramDrafter, adaptive
      fallback) and `generate(prompt_lookup_num_tokens=10)`, the speed-up ratios, acceptance, and
      the draft + bookkeeping overhead per step (decode wall time not spent in model forwards).
      The model is a BASE model: it loops, which inflates drafting gains; compare with care.
  python -m bench.engine_bench --gpu-e4b CONFIG_JSON
      Random-init Gemma4ForCausalLM from the E4B text config, quanto int4, bf16, cuda: plain
      tokens/s through the Engine and the verify cost curve (1..16 new tokens) at 1k and 8k context.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from server.engine import Engine, EngineConfig, GenerationParams


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}..{max(values):.2f})"


def _engine_run(engine: Engine, prompt: list[int], max_tokens: int, draft: bool):
    tokens, stats = [], None
    t0 = time.perf_counter()
    for chunk in engine.generate(prompt, GenerationParams(max_tokens=max_tokens, draft=draft)):
        tokens += chunk.token_ids
        stats = chunk.stats
    return tokens, stats, time.perf_counter() - t0


def _hf_prompt_lookup(model, prompt: list[int], max_tokens: int, eos: frozenset[int]):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             prompt_lookup_num_tokens=10)
    wall = time.perf_counter() - t0
    return [t for t in out[0, len(prompt):].tolist() if t not in eos], wall


def cpu_bench(args) -> None:
    from bench.workloads import prose_requests, tool_call_requests
    from index.chat_format import ChatFormat
    from ngram.drafter import NgramDrafter
    from server.model_loading import load_target

    target = load_target(None)
    index = None
    if args.index:
        from ngram.index_file import load_index

        index = load_index(args.index)
    t0 = time.perf_counter()
    engine = Engine(target, NgramDrafter(index), EngineConfig())
    print(f"cost curve measured in {time.perf_counter() - t0:.1f} s:",
          " ".join(f"{n}:{c:.2f}" for n, c in enumerate(engine.policy.cost) if n))
    fmt = ChatFormat.for_tokenizer(target.tokenizer)
    for name, make in (("tool_calls", tool_call_requests), ("prose", prose_requests)):
        rows = {"plain": [], "drafted": [], "hf_prompt_lookup": []}
        acc, overhead, identical = [], [], 0
        requests = make(args.requests)
        for req in requests:
            text = fmt.render_prompt(req["messages"], req["tools"])
            prompt = target.tokenizer(text, add_special_tokens=False)["input_ids"][-args.max_prompt:]
            plain, ps, _ = _engine_run(engine, prompt, args.max_tokens, draft=False)
            drafted, ds, _ = _engine_run(engine, prompt, args.max_tokens, draft=True)
            hf, hf_wall = _hf_prompt_lookup(target.model, prompt, args.max_tokens, engine.eos_token_ids)
            identical += drafted == plain
            rows["plain"].append(ps.tokens_per_s)
            rows["drafted"].append(ds.tokens_per_s)
            # generate's wall time includes its prefill: subtract ours for the same prompt
            rows["hf_prompt_lookup"].append(max(len(hf) - 1, 0) / max(hf_wall - ps.prefill_s, 1e-9))
            if ds.drafted_tokens:
                acc.append(ds.accepted_tokens / ds.drafted_tokens)
            steps = ds.verify_steps + ds.plain_steps
            if steps:
                overhead.append((ds.decode_s - ds.forward_s) / ds.decode_s * 100)
            print(f"  {req['id'][:40]:40s} prompt {len(prompt):5d}  plain {ps.tokens_per_s:5.2f}  drafted "
                  f"{ds.tokens_per_s:5.2f} (verify {ds.verify_steps}, plain {ds.plain_steps}, accepted "
                  f"{ds.accepted_tokens}/{ds.drafted_tokens})  hf-pld {rows['hf_prompt_lookup'][-1]:5.2f}")
        print(f"\n{name}: {len(requests)} requests, {args.max_tokens} max tokens, decode tokens/s median (min..max)")
        for key, values in rows.items():
            print(f"  {key:18s} {_spread(values)}")
        ratio = [d / p for d, p in zip(rows["drafted"], rows["plain"])]
        ratio_hf = [d / h for d, h in zip(rows["drafted"], rows["hf_prompt_lookup"])]
        print(f"  drafted / plain     {_spread(ratio)}")
        print(f"  drafted / hf-pld    {_spread(ratio_hf)}")
        print(f"  acceptance          {_spread(acc) if acc else 'no drafts verified'}")
        print(f"  overhead % of decode time (drafting + bookkeeping) {_spread(overhead) if overhead else '-'}")
        print(f"  drafted == plain on {identical}/{len(requests)} requests\n")
    print("totals:", json.dumps(engine.totals()))


def gpu_e4b(args) -> None:
    from optimum.quanto import freeze, qint4, quantize
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    from server.cost_model import measure_cost_curve
    from server.model_loading import LoadedTarget

    config = Gemma4TextConfig(**{k: v for k, v in json.load(open(args.gpu_e4b)).items()
                                 if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Gemma4ForCausalLM(config).to(torch.bfloat16).eval()
    quantize(model, weights=qint4, exclude=["lm_head"])
    freeze(model)
    model.generation_config.eos_token_id = None
    print(f"model ready, {torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU")
    for ctx in (1024, 8192):
        t0 = time.perf_counter()
        curve = measure_cost_curve(model, 16, ctx, repeats=5, points=tuple(range(1, 17)))
        print(f"verify cost curve at {ctx} context ({time.perf_counter() - t0:.0f} s):",
              " ".join(f"{n}:{c:.2f}" for n, c in enumerate(curve) if n))
    target = LoadedTarget(model, _NoTokenizer(), "e4b-random", "int4", torch.bfloat16, torch.device("cuda"), [])
    engine = Engine(target, None, EngineConfig(adaptive=False))
    prompt = torch.randint(3, config.vocab_size, (1024,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = [_engine_run(engine, prompt, args.max_tokens, draft=False)[1].tokens_per_s for _ in range(3)]
    print(f"plain decode tokens/s at 1k context, {args.max_tokens} tokens: {_spread(runs)}")


class _NoTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=1500, help="keep the last N prompt tokens")
    ap.add_argument("--index", help="an n-gram index for the drafter (default: live-context lookup only)")
    ap.add_argument("--gpu-e4b", metavar="CONFIG_JSON", help="E4B-shape GPU mode (see the docstring)")
    args = ap.parse_args()
    gpu_e4b(args) if args.gpu_e4b else cpu_bench(args)


if __name__ == "__main__":
    main()
