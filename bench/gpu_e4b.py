"""Gemma 4 E4B shape on one GPU: the transformers eager path against the fast path (server/fast_path.py).

Random-init `Gemma4ForCausalLM` from `bench/configs/gemma4-e4b-text-config.json`, bf16 activations,
optimum-quanto int4 weights (lm_head = tied embedding kept bf16). Random weights give the true time
of every forward (values do not change timing), not true acceptance. Measures, in one run:

- the card's copy bandwidth (device-to-device copy, bytes read + written);
- eager (transformers, DynamicCache) forward time for 1..16 new tokens at 1k and 8k context, and
  plain decode tokens/s at 1k;
- fast path: graph capture time, step time for 1..16 new tokens at 1k and 8k, plain decode
  tokens/s, drafted decoding with an oracle drafter that proposes the model's own earlier greedy
  output (the ceiling of drafting), memory, and each step's bytes against the bandwidth floor;
- through `server.engine.Engine` on its fast path (built, captured and cost-measured by the engine
  as the server does): plain tokens/s, drafted tokens/s with the real `NgramDrafter` over an index
  of the model's own earlier plain output on the same prompt (the ceiling of drafting), and with an
  oracle drafter; whether drafted output equals plain, and the per-token rate at which a batched
  16-token verify's argmax disagrees with the one-token steps' (teacher-forced on the plain output);
- the same on a "peaked" variant (see `make_peaked`), whose argmax margins are large, as a trained
  model's are: random init is near-tied, so bf16/int4 rounding flips its argmax;
- fp32 (no quant) fast path vs transformers logits at the full E4B depth (is there a bug?);
- the same steps on tinygemm/cuBLAS (the path without step kernels), and a kernel profile of an
  uncaptured 1- and 16-token step.

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

import numpy as np

from server.backend import time_forwards
from server.fast_path import FastTarget
from bench.fast_greedy import greedy_generate

PEAK_UPDATE_SCALE = 0.1   # peaked variant: every layer's post-norm weights x this

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


def build_model(quant: bool, dtype=torch.bfloat16, on_host: bool = False):
    """The random-init E4B text model on the GPU (quanto int4 when `quant`). `on_host`: unquantized
    and in host memory, as transformers' from_pretrained leaves a checkpoint for the server's loader
    (server.model_loading.place_on_device); built on the GPU (random init is slow on the host), moved
    off, the cache emptied."""
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    cfg = Gemma4TextConfig(**{k: v for k, v in json.loads(CONFIG.read_text()).items()
                              if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = Gemma4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    model.generation_config.eos_token_id = None
    if on_host:
        model.to("cpu")
        torch.cuda.empty_cache()
        return model
    if quant:
        from optimum.quanto import freeze, qint4, quantize
        quantize(model, weights=qint4, exclude=["lm_head"])
        freeze(model)
    return model


def make_peaked(model, seed: int = 1) -> torch.Tensor:
    """The peaked variant, in place: (1) every decoder layer's post-attention, post-feedforward and
    post-per-layer-input RMSNorm weights are multiplied by PEAK_UPDATE_SCALE, so each layer adds a
    small update to the residual stream and the current token's embedding stays a large part of the
    final hidden state; (2) the LM head is untied and set to the embedding's rows permuted by a
    random permutation `perm` (logit i = <embedding[perm[i]], h>). The argmax then leans strongly to
    the token i with perm[i] == current token, shifted by the context through the layers: a large
    top-1 margin, without the trivial "repeat the last token" of a tied head. Same shapes, same
    timing (the head is still a bf16 262144 x 2560 matrix; +1.3 GB memory). Returns perm."""
    for layer in model.model.layers:
        for name in ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm"):
            norm = getattr(layer, name, None)
            if norm is not None and getattr(norm, "weight", None) is not None:
                norm.weight.data.mul_(PEAK_UPDATE_SCALE)
    g = torch.Generator().manual_seed(seed)
    emb = model.model.embed_tokens.weight
    perm = torch.randperm(emb.shape[0], generator=g).to(emb.device)
    model.lm_head.weight = torch.nn.Parameter(emb.data.index_select(0, perm), requires_grad=False)
    model.config.tie_word_embeddings = False
    return perm


class IdTokenizer:
    """Token i decodes as '<i>': the engine's text bookkeeping without a vocabulary."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{int(i)}>" for i in ids)


class CharTokenizer:
    """Token i decodes as one character: the engine's text bookkeeping, cheaply, without a vocabulary
    (no stop strings are set where it serves)."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(0x4E00 + int(i) % 20000) for i in ids)


def random_e4b_target(model):
    """The random-init E4B model as the engine's LoadedTarget (what server.model_loading gives)."""
    from server.model_loading import LoadedTarget

    return LoadedTarget(model, CharTokenizer(), "gemma4-e4b-shape-random-int4", "int4", torch.bfloat16,
                        torch.device("cuda"), [])


class OracleDrafter:
    """Proposes the recorded continuation `reference` from the current point (engine interface)."""

    def __init__(self, reference, prompt_len):
        self.reference, self.prompt_len = list(reference), prompt_len

    def session(self):
        return self

    def propose(self, context, max_tokens):
        from ngram.draft import Draft
        start = len(context) - self.prompt_len  # context ends with the pending token
        toks = np.asarray(self.reference[start:start + max_tokens], dtype=np.int32)
        return Draft(toks, np.ones(len(toks), dtype=np.float32), "oracle", 32)

    def prepare(self, context_ids):
        pass

    def feedback(self, drafted, accepted):
        pass

    def finish(self, context_ids=None):
        pass


def ngram_drafter_of(prompt, plain, tmp):
    """The real NgramDrafter over an index holding one turn: the prompt's anchor + the plain output."""
    from ngram.drafter import NgramDrafter
    from ngram.index_file import BuildParams, load_index, write_index
    params = BuildParams()
    write_index(tmp, [np.asarray(prompt[-params.anchor_tokens:] + plain, dtype=np.int32)], "bench-e4b", params)
    return NgramDrafter(load_index(tmp))


def engine_run(engine, prompt, n, draft):
    from server.engine import GenerationParams
    out, stats = [], None
    for chunk in engine.generate(prompt, GenerationParams(max_tokens=n, draft=draft)):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


def teacher_forced_disagreement(fast, prompt, plain, chunk=16):
    """Per token: does a `chunk`-token step's argmax differ from the plain (one-token-step) output?"""
    fast.prefill(prompt)
    diff = total = 0
    for i in range(0, len(plain) - chunk, chunk):
        got = fast.step(plain[i:i + chunk]).argmax(-1).tolist()
        want = plain[i + 1:i + chunk + 1]
        diff += sum(a != b for a, b in zip(got, want))
        total += len(want)
    return diff / max(total, 1)


def margins(fast, prompt, plain, n=64):
    """Median top-1 minus top-2 logit over the first n plain steps (teacher-forced, one token each)."""
    out = [float((lambda t: t[0] - t[1])(fast.prefill(prompt).float().topk(2).values))]
    for tok in plain[:n - 1]:
        v = fast.step([tok])[0].float().topk(2).values
        out.append(float(v[0] - v[1]))
    return statistics.median(out)


def engine_decode(engine, prompt, gen, tmp, perm=None):
    """Plain, n-gram-drafted and oracle-drafted decoding through the engine; equality and rates."""
    engine.set_drafter(None)
    engine_run(engine, prompt, 8, False)  # warm
    plain, ps = engine_run(engine, prompt, gen, False)
    r = {"tokens": gen, "plain_tps": ps.tokens_per_s}
    for name, drafter in (("ngram", ngram_drafter_of(prompt, plain, tmp)), ("oracle", OracleDrafter(plain, len(prompt)))):
        engine.set_drafter(drafter)
        out, st = engine_run(engine, prompt, gen, True)
        div = next((i for i, (a, b) in enumerate(zip(plain, out)) if a != b), None)
        r[name] = {"tps": st.tokens_per_s, "equals_plain": out == plain, "first_divergence": div,
                   "verify_steps": st.verify_steps, "plain_steps": st.plain_steps, "drafted": st.drafted_tokens,
                   "accepted": st.accepted_tokens, "forward_s": st.forward_s, "draft_s": st.draft_s,
                   "decode_s": st.decode_s}
    engine.set_drafter(None)
    r["verify16_disagreement_per_token"] = teacher_forced_disagreement(engine.fast, prompt, plain)
    r["median_top1_margin"] = margins(engine.fast, prompt, plain)
    r["distinct_tokens"] = len(set(plain))
    if perm is not None:  # how often the output is just the permutation map of the current token
        inv = {int(t): i for i, t in enumerate(perm.tolist())}
        seq = [prompt[-1]] + plain
        r["follows_perm_map"] = sum(inv[a] == b for a, b in zip(seq, seq[1:])) / len(plain)
    return r


def profile_forward(fast, T, reps=5):
    """Top CUDA kernels (total ms over reps) of an uncaptured T-token forward."""
    from torch.profiler import ProfilerActivity, profile
    ids = torch.zeros(T, dtype=torch.long, device="cuda")
    pos = torch.arange(1024, 1024 + T, device="cuda")
    kv = fast._kv_len(1024 + T)
    fast._forward(ids, pos, kv, step=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fast._forward(ids, pos, kv, step=True)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows.append((t / 1e3 / reps, e.count // reps, e.key[:90]))
    rows.sort(reverse=True)
    return {"total_ms": sum(r[0] for r in rows), "kernels_per_forward": sum(r[1] for r in rows),
            "top": rows[:14]}


def fp32_check(prompt):
    """fp32, no quant, full E4B depth: fast path (uncaptured, unfused) vs transformers logits."""
    model = build_model(quant=False, dtype=torch.float32)
    r = {}
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prompt], device="cuda"), use_cache=False, logits_to_keep=17).logits[0].float()
        fast = FastTarget(model, max_len=1024, capture=False, fuse=False)
        got = fast.prefill(prompt[:-16]).float()
        r["prefill_rel_err"] = float((got - ref[0]).norm() / ref[0].norm())
        steps = fast.step(prompt[-16:]).float()
        r["step16_rel_err"] = float((steps - ref[1:]).norm() / ref[1:].norm())
        r["same_argmax"] = int((torch.cat([got[None], steps]).argmax(-1) == ref.argmax(-1)).sum())
        r["positions"] = 17
        fused = FastTarget(model, max_len=1024, capture=True, fuse=True)
        fused.prefill(prompt[:-16])
        steps = fused.step(prompt[-16:]).float()
        r["captured_fused_step16_rel_err"] = float((steps - ref[1:]).norm() / ref[1:].norm())
    del model, fast, fused
    torch.cuda.empty_cache()
    return r


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

def weight_bytes_per_step(fast) -> int:
    """Bytes of weights a forward streams: every linear layer plus one embedding row per token."""
    total = fast.lm_head.nbytes()
    if fast.ple_dim:
        total += fast.ple_model_proj.nbytes()
    for layer in fast.layers:
        for lin in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down,
                    layer.ple_gate, layer.ple_proj):
            if lin is not None:
                total += lin.nbytes()
    return total


def kv_bytes_per_step(fast, context: int) -> int:
    """Bytes of K and V the attention of one forward reads at this context (graph buckets)."""
    kv_len = fast._kv_len(context + 1)
    total = 0
    for layer in fast.layers:
        slots = fast.ring if layer.sliding else kv_len
        total += 2 * layer.kv_heads * slots * layer.head_dim * fast.k_cache[layer.source].element_size()
    return total


def fast_curve(fast, prompt, max_n, reps):
    """Seconds of an n-token step on `prompt`'s cache, n = 1..max_n, as the server measures them."""
    return time_forwards(fast, prompt, list(range(1, max_n + 1)), rounds=reps)


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
    ap.add_argument("--quick-skip-fp32", action="store_true", help="skip the fp32 full-depth check")
    args = ap.parse_args()
    reps = 5 if args.quick else 20
    import transformers

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "python": platform.python_version(),
                 "model": "Gemma4ForCausalLM, E4B text config, random init; bf16 activations; quanto qint4 "
                          "weights (group 128), lm_head (tied embedding) bf16; fast-path steps on Sailfish's Triton step "
                          "kernels (int4 re-laid out), prefill on tinygemm"}
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
        # the eager reference for the correctness check below (the engine then moves the per-layer
        # embedding table to the host, and transformers' forward no longer runs on this model)
        check_prompt = prompts["1k"][:600]
        ref = model(input_ids=torch.tensor([check_prompt], device="cuda"), use_cache=False,
                    logits_to_keep=1).logits[0, -1].float()
    torch.cuda.empty_cache()

    # The same steps on tinygemm/cuBLAS (no step kernels; fused q|k|v and gate|up), same run: before
    # the engine's fast path releases quanto's int4 tensors (after that a FastTarget without step
    # kernels dequantizes the step kernels' layout per call, which is not tinygemm).
    old = FastTarget(model, max_len=2048, step_kernels=False, ple_on_host=True)
    oc = fast_curve(old, prompts["1k"], 1, reps)
    old.prefill(prompts["1k"])
    oc16 = statistics.median(sync_time(lambda: (old.step(prompts["1k"][-16:]).argmax(-1).tolist(),
                                                old.rollback(16)), reps + 1)[1:])
    res["tinygemm_step_s"] = {"1": oc[1], "16": oc16}
    print("tinygemm steps", res["tinygemm_step_s"])
    del old
    torch.cuda.empty_cache()

    # fast path, built by the engine as the server builds it (capture, cost curve, context cap)
    from server.engine import Engine, EngineConfig
    from server.model_loading import LoadedTarget
    target = LoadedTarget(model, IdTokenizer(), "e4b-random", "int4", torch.bfloat16, torch.device("cuda"), [])
    config = EngineConfig(fast_max_context=8192 + 2 * args.gen)
    mem0 = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    engine = Engine(target, None, config)
    res["engine_start_s"] = time.perf_counter() - t
    fast = engine.fast
    res["engine_notes"] = engine.notes
    res["engine_cost_curve"] = [round(float(c), 3) for c in engine.policy.cost]
    res["fused_layers"] = fast.fused_layers
    res["step_kernel_note"] = fast.step_kernel_note
    res["fast_cache_GiB"] = fast.cache_bytes() / 2**30
    res["fast_capture_s"] = fast.timings.capture_s
    res["fast_graphs"] = fast.timings.graphs
    res["fast_extra_mem_GiB"] = (torch.cuda.memory_allocated() - mem0) / 2**30
    res["mem_serving_GiB"] = torch.cuda.memory_allocated() / 2**30  # the per-layer embeddings now on the host
    res["weight_bytes_per_step"] = weight_bytes_per_step(fast)
    print("engine:", engine.notes, "cost", res["engine_cost_curve"])

    # correctness on E4B: fast vs eager logits for the same prompt
    with torch.no_grad():
        got = fast.prefill(check_prompt).float()
        res["fast_vs_eager_rel_err"] = float((got - ref).norm() / ref.norm())
        res["fast_vs_eager_same_argmax"] = bool(got.argmax() == ref.argmax())
    print("fast vs eager rel err", res["fast_vs_eager_rel_err"])

    bw = res["copy_bandwidth_GBps"] * 1e9
    res["fast_curve_s"], res["floor"] = {}, {}
    for name, prompt in prompts.items():
        res["fast_curve_s"][name] = curve = fast_curve(fast, prompt, 16, reps)
        kv = kv_bytes_per_step(fast, len(prompt))
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

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        res["engine_decode"] = {"random": engine_decode(engine, prompts["1k"], args.gen, Path(tmp) / "a")}
        print("engine random", res["engine_decode"]["random"])
        res["profile"] = {T: profile_forward(fast, T) for T in (1, 16)}
        print("profile", json.dumps(res["profile"], indent=0)[:3000])
        res["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        # peaked variant: same model, post-norms scaled and a permuted untied head; a new engine
        del engine, fast
        torch.cuda.empty_cache()
        perm = make_peaked(model)
        engine = Engine(target, None, config)
        res["engine_decode"]["peaked"] = engine_decode(engine, prompts["1k"], args.gen, Path(tmp) / "b", perm)
        print("engine peaked", res["engine_decode"]["peaked"])
    del engine, model
    torch.cuda.empty_cache()
    if not args.quick_skip_fp32:
        res["fp32_check"] = fp32_check(prompts["1k"][:600])
        print("fp32 check", res["fp32_check"])

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
        "The first table drives FastTarget directly (`greedy_generate`); the engine section below runs the server's loop.",
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
        f"fast path adds {r['fast_extra_mem_GiB']:.2f} GiB (static KV cache {r['fast_cache_GiB']:.2f} GiB, "
        f"the step kernels' int4 copy of the weights, graphs' buffers; it moves the per-layer embedding table to "
        f"host memory), {r.get('mem_serving_GiB', float('nan')):.2f} GiB in use while serving, peak {r['peak_mem_GiB']:.2f} GiB.",
        f"Fast vs eager logits (600-token prompt): relative error {r['fast_vs_eager_rel_err']:.2e}, "
        f"same argmax: {r['fast_vs_eager_same_argmax']}.",
        "",
        f"Weight-bytes floor: copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s (read + write); a step streams "
        f"{r['weight_bytes_per_step'] / 1e9:.2f} GB of weights plus the KV it reads.",
    ]
    lines += ["", "## Through the engine (server.engine.Engine, fast path), 1k context, "
              f"{r['engine_decode']['random']['tokens']} tokens", "",
              "Start-up notes: " + "; ".join(r["engine_notes"]) + f". Engine start {r['engine_start_s']:.1f} s. "
              "Cost curve measured through the fast path (n new tokens / 1): "
              + " ".join(f"{n}:{c:.2f}" for n, c in enumerate(r["engine_cost_curve"]) if n >= 1) + ".", "",
              "| model | plain | n-gram drafter, index = own plain output | oracle drafter | "
              "16-token verify argmax != one-token steps (per token) | median top-1 margin | distinct tokens |",
              "|---|---|---|---|---|---|---|"]
    for variant, d in r["engine_decode"].items():
        cells = [f"{d['plain_tps']:.0f} tok/s"]
        for k in ("ngram", "oracle"):
            x = d[k]
            cells.append(f"{x['tps']:.0f} tok/s; {x['verify_steps']} verifies + {x['plain_steps']} plain steps, "
                         f"{x['accepted']}/{x['drafted']} drafted accepted; equals plain: {x['equals_plain']}"
                         + (f" (first divergence at token {x['first_divergence']})" if not x["equals_plain"] else ""))
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {d['verify16_disagreement_per_token']:.1%} | "
                     f"{d['median_top1_margin']:.2f} | {d['distinct_tokens']} |")
    pk = r["engine_decode"].get("peaked", {})
    if pk:
        lines += ["", f"Peaked variant (`make_peaked`): every layer's post-norm weights x{PEAK_UPDATE_SCALE}, LM head "
                  "untied and set to the embedding rows under a random permutation. "
                  f"{pk.get('follows_perm_map', 0):.0%} of its output tokens are the permutation image of the "
                  "previous token: it is close to a fixed token map, so its acceptance says how fast drafting can "
                  "go when the target's argmax is stable, not what a trained model accepts."]
    if "fp32_check" in r:
        c = r["fp32_check"]
        lines += ["", f"fp32, no quant, full E4B depth, fast path vs transformers logits (600-token prompt): prefill "
                  f"relative error {c['prefill_rel_err']:.1e}, uncaptured 16-token step {c['step16_rel_err']:.1e}, "
                  f"captured + fused-ops 16-token step {c['captured_fused_step16_rel_err']:.1e}; same argmax at "
                  f"{c['same_argmax']}/{c['positions']} positions."]
    if "tinygemm_step_s" in r:
        u = r["tinygemm_step_s"]
        lines += ["", f"Step kernels: {r.get('step_kernel_note', '')}. The same steps on tinygemm/cuBLAS (fused int4 "
                  f"q|k|v and gate|up), in this run: 1-token {u['1'] * 1e3:.2f} ms, 16-token {u['16'] * 1e3:.2f} ms "
                  f"({u['16'] / u['1']:.2f}x) against {f['1k'][1] * 1e3:.2f} / {f['1k'][16] * 1e3:.2f} ms "
                  f"({f['1k'][16] / f['1k'][1]:.2f}x) on the step kernels (1k context)."]
    if "profile" in r:
        lines += ["", "Kernel profile of an uncaptured forward (ms per forward, count, kernel):", ""]
        for T, pr in r["profile"].items():
            lines.append(f"- {T} token(s): {pr['total_ms']:.2f} ms of kernels, {pr['kernels_per_forward']} kernels; top: "
                         + "; ".join(f"{ms:.2f} ms x{n} {name}" for ms, n, name in pr["top"][:6]))
    lines += ["", "## Weight-bytes floor", "",
              "| context | bytes / step | floor | 1-token step | floor / step (1) | floor / step (16) |",
              "|---|---|---|---|---|---|"]
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
