"""Gemma 4 E4B shape on one GPU: the transformers eager path against the fast path (server/fast_path.py).

Random-init `Gemma4ForCausalLM` from `bench/configs/gemma4-e4b-text-config.json`, bf16 activations,
optimum-quanto int4 weights (lm_head = tied embedding kept bf16). Random weights give the true time
of every forward (values do not change timing), not true acceptance. Measures, in one run:

- the card's copy bandwidth (device-to-device copy, bytes read + written);
- eager (transformers, DynamicCache) forward time for 1..16 new tokens at 1k and 8k context, and
  plain decode tokens/s at 1k;
- fast path: graph capture time, step time for 1..16 new tokens at 1k and 8k, plain decode
  tokens/s, drafted decoding with an oracle drafter that proposes the model's own earlier greedy
  output (the ceiling of drafting), memory, and each step's bytes against the bandwidth floor.

Usage (GPU machine): python -m bench.gpu_e4b [--out DIR] [--quick]
Writes DIR/gpu_e4b.json and DIR/gpu_e4b.md (default bench/results/).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from server.fast_path import FastTarget, greedy_generate

CONFIG = Path(__file__).parent / "configs" / "gemma4-e4b-text-config.json"


def sync_time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (median of 20)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); b.copy_(a); e.record(); e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * 2 * n / statistics.median(times)


def build_model(quant: bool):
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    cfg = Gemma4TextConfig(**{k: v for k, v in json.loads(CONFIG.read_text()).items()
                              if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Gemma4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    model.generation_config.eos_token_id = None
    if quant:
        from optimum.quanto import freeze, qint4, quantize
        quantize(model, weights=qint4, exclude=["lm_head"])
        freeze(model)
    return model


# ---------------------------------------------------------------- eager (transformers) path

def _cache_kwarg(model) -> str:
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def eager_prefill(model, ids):
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    kw = {_cache_kwarg(model): cache}
    model(input_ids=torch.tensor([ids], device="cuda"), use_cache=True, logits_to_keep=1, **kw)
    return cache, kw


def eager_crop(cache, n):
    if n == 0:
        return
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            try:
                layer.crop(-n)
            except Exception:
                pass  # timing only: a sliding layer past its window cannot crop; it stays a little longer


def eager_curve(model, prompt, max_n, reps):
    cache, kw = eager_prefill(model, prompt)
    curve = {}
    for n in range(1, max_n + 1):
        ids = torch.tensor([prompt[-n:]], device="cuda")

        def one():
            model(input_ids=ids, use_cache=True, logits_to_keep=n, **kw).logits.argmax(-1).tolist()
            eager_crop(cache, n)
        one()
        curve[n] = statistics.median(sync_time(one, reps))
    return curve


def eager_plain_tps(model, prompt, n_tokens):
    cache, kw = eager_prefill(model, prompt)
    tok = prompt[-1]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n_tokens):
        logits = model(input_ids=torch.tensor([[tok]], device="cuda"), use_cache=True, logits_to_keep=1, **kw).logits
        tok = int(logits[0, -1].argmax())
    return n_tokens / (time.perf_counter() - t)


# ---------------------------------------------------------------- fast path

def fast_curve(fast, prompt, max_n, reps):
    fast.prefill(prompt)
    curve = {}
    for n in range(1, max_n + 1):
        ids = prompt[-n:]

        def one():
            fast.step(ids).argmax(-1).tolist()
            fast.rollback(n)
        one()
        curve[n] = statistics.median(sync_time(one, reps))
    return curve


def oracle_drafter(reference, prompt_len):
    """Proposes the model's own recorded greedy continuation from the current point (the ceiling)."""
    def propose(context, room):
        start = len(context) - prompt_len
        return reference[start:start + room]
    return propose


def timed_generate(fast, prompt, n, propose=None):
    """Decode seconds exclude the prefill (timed alone first, then subtracted)."""
    prefill_s = min(sync_time(lambda: fast.prefill(prompt).argmax().item(), 2))
    torch.cuda.synchronize()
    t = time.perf_counter()
    out, steps = greedy_generate(fast, prompt, n, propose)
    torch.cuda.synchronize()
    return out, steps, time.perf_counter() - t - prefill_s


def full_accept_tps(fast, prompt, steps=32):
    """The verify loop with every draft accepted (forced): 16-token steps whose argmax is read back
    and nothing rolled back; 16 tokens committed per step. The ceiling of drafting, by construction."""
    fast.prefill(prompt)
    ids = prompt[-fast.max_bucket:]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fast.step(ids).argmax(-1).tolist()
    torch.cuda.synchronize()
    return steps * fast.max_bucket / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--gen", type=int, default=256, help="tokens generated per decode measurement")
    args = ap.parse_args()
    reps = 5 if args.quick else 20
    import transformers

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "python": platform.python_version(),
                 "model": "Gemma4ForCausalLM, E4B text config, random init; bf16 activations; quanto qint4 "
                          "weights (group 128, tinygemm), lm_head (tied embedding) bf16"}
    res["copy_bandwidth_GBps"] = copy_bandwidth() / 1e9
    print("copy bandwidth GB/s", round(res["copy_bandwidth_GBps"]))

    t = time.perf_counter()
    model = build_model(quant=True)
    torch.cuda.synchronize()
    res["load_and_quantize_s"] = time.perf_counter() - t
    res["mem_after_load_GiB"] = torch.cuda.memory_allocated() / 2**30
    print("model ready", res["load_and_quantize_s"], "s", res["mem_after_load_GiB"], "GiB")

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = {"1k": torch.randint(3, vocab, (1024,), generator=g).tolist(),
               "8k": torch.randint(3, vocab, (8192,), generator=g).tolist()}

    # eager transformers path
    with torch.no_grad():
        res["eager_curve_s"] = {}
        for name, prompt in prompts.items():
            res["eager_curve_s"][name] = eager_curve(model, prompt, 16, 3)
            print("eager", name, {k: round(v * 1e3, 1) for k, v in res["eager_curve_s"][name].items()})
        res["eager_plain_tps_1k"] = eager_plain_tps(model, prompts["1k"], 24)
        print("eager plain tok/s 1k", res["eager_plain_tps_1k"])
    torch.cuda.empty_cache()

    # fast path
    mem0 = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fast = FastTarget(model, max_len=8192 + 1024)
    res["fast_cache_GiB"] = fast.cache_bytes() / 2**30
    res["fast_capture_s"] = fast.warmup()
    res["fast_graphs"] = fast.timings.graphs
    res["fast_extra_mem_GiB"] = (torch.cuda.memory_allocated() - mem0) / 2**30
    res["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    res["weight_bytes_per_step"] = fast.weight_bytes_per_step()
    print("captured", res["fast_graphs"], "graphs in", res["fast_capture_s"], "s")

    # correctness on E4B: fast vs eager logits for the same prompt
    with torch.no_grad():
        p = prompts["1k"][:600]
        ref = model(input_ids=torch.tensor([p], device="cuda"), use_cache=False, logits_to_keep=1).logits[0, -1].float()
        got = fast.prefill(p).float()
        res["fast_vs_eager_rel_err"] = float((got - ref).norm() / ref.norm())
        res["fast_vs_eager_same_argmax"] = bool(got.argmax() == ref.argmax())
    print("fast vs eager rel err", res["fast_vs_eager_rel_err"])

    bw = res["copy_bandwidth_GBps"] * 1e9
    res["fast_curve_s"], res["floor"] = {}, {}
    for name, prompt in prompts.items():
        res["fast_curve_s"][name] = curve = fast_curve(fast, prompt, 16, reps)
        kv = fast.kv_bytes_per_step(len(prompt))
        floor_s = (res["weight_bytes_per_step"] + kv) / bw
        res["floor"][name] = {"bytes_per_step": res["weight_bytes_per_step"] + kv, "kv_bytes": kv,
                              "floor_ms": floor_s * 1e3, "step1_ms": curve[1] * 1e3,
                              "fraction_of_floor_1": floor_s / curve[1], "fraction_of_floor_16": floor_s / curve[16]}
        print("fast", name, {k: round(v * 1e3, 2) for k, v in curve.items()})

    res["decode"] = {}
    for name, prompt in prompts.items():
        plain, steps, secs = timed_generate(fast, prompt, args.gen)
        drafted, dsteps, dsecs = timed_generate(fast, prompt, args.gen, oracle_drafter(plain, len(prompt)))
        diverge = next((i for i, (a, b) in enumerate(zip(plain, drafted)) if a != b), None)
        res["decode"][name] = {"tokens": args.gen, "plain_tps": args.gen / secs, "plain_steps": steps,
                               "drafted_tps": args.gen / dsecs, "drafted_steps": dsteps,
                               "drafted_equals_plain": diverge is None, "first_divergence": diverge,
                               "full_accept_tps": full_accept_tps(fast, prompt)}
        print("decode", name, res["decode"][name])
    res["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_e4b.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / "gpu_e4b.md").write_text(markdown(res))
    print(markdown(res))


def markdown(r: dict) -> str:
    e, f = r["eager_curve_s"], r["fast_curve_s"]
    lines = [
        "# Gemma 4 E4B shape on one GPU: transformers eager vs the fast path",
        "",
        f"{r['device']}, torch {r['torch']}, transformers {r['transformers']}. {r['model']}.",
        "Random weights: timings are real, acceptance is not. Command: `python -m bench.gpu_e4b`.",
        "",
        "| | eager (transformers) | fast path |",
        "|---|---|---|",
        f"| plain decode, 1k context | {r['eager_plain_tps_1k']:.1f} tok/s | {r['decode']['1k']['plain_tps']:.0f} tok/s |",
        f"| plain decode, 8k context | | {r['decode']['8k']['plain_tps']:.0f} tok/s |",
        "| (decode figures exclude the prefill) | | |",
        f"| drafted, oracle drafter (own earlier output), 1k | | {r['decode']['1k']['drafted_tps']:.0f} tok/s "
        f"({r['decode']['1k']['drafted_steps']} steps for {r['decode']['1k']['tokens']} tokens; "
        f"equals plain: {r['decode']['1k']['drafted_equals_plain']}) |",
        f"| drafted, oracle drafter, 8k | | {r['decode']['8k']['drafted_tps']:.0f} tok/s "
        f"(equals plain: {r['decode']['8k']['drafted_equals_plain']}) |",
        f"| every draft accepted (forced 16-token verifies), 1k | | {r['decode']['1k']['full_accept_tps']:.0f} tok/s |",
        f"| every draft accepted (forced 16-token verifies), 8k | | {r['decode']['8k']['full_accept_tps']:.0f} tok/s |",
        f"| verify 16 / decode 1, 1k | {e['1k'][16] / e['1k'][1]:.2f}x | {f['1k'][16] / f['1k'][1]:.2f}x |",
        f"| verify 16 / decode 1, 8k | {e['8k'][16] / e['8k'][1]:.2f}x | {f['8k'][16] / f['8k'][1]:.2f}x |",
        "",
        f"Start-up: load + quanto int4 {r['load_and_quantize_s']:.1f} s; fast path captured {r['fast_graphs']} CUDA graphs "
        f"in {r['fast_capture_s']:.1f} s (this includes torch.compile of the fused elementwise ops). Memory: {r['mem_after_load_GiB']:.2f} GiB after loading, "
        f"fast path adds {r['fast_extra_mem_GiB']:.2f} GiB (static KV cache {r['fast_cache_GiB']:.2f} GiB for 9216 positions, "
        f"graphs' buffers), peak {r['peak_mem_GiB']:.2f} GiB.",
        f"Fast vs eager logits (600-token prompt): relative error {r['fast_vs_eager_rel_err']:.2e}, "
        f"same argmax: {r['fast_vs_eager_same_argmax']}.",
        "",
        f"Weight-bytes floor: copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s (read + write); a step streams "
        f"{r['weight_bytes_per_step'] / 1e9:.2f} GB of weights plus the KV it reads.",
        "",
        "| context | bytes / step | floor | 1-token step | floor / step (1) | floor / step (16) |",
        "|---|---|---|---|---|---|",
    ]
    for name, fl in r["floor"].items():
        lines.append(f"| {name} | {fl['bytes_per_step'] / 1e9:.2f} GB | {fl['floor_ms']:.2f} ms | {fl['step1_ms']:.2f} ms | "
                     f"{fl['fraction_of_floor_1']:.0%} | {fl['fraction_of_floor_16']:.0%} |")
    lines += ["", "Forward time (ms, median, host sync included) by new tokens:", "",
              "| path | context | " + " | ".join(str(n) for n in range(1, 17)) + " |",
              "|---|---|" + "---|" * 16]
    for label, curves in (("eager", e), ("fast", f)):
        for name, c in curves.items():
            lines.append(f"| {label} | {name} | " + " | ".join(f"{c[n] * 1e3:.1f}" for n in range(1, 17)) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
