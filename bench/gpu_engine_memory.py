"""GPU memory of the server's engine under `--gpu-memory-mb`, each context in a fresh process (GPU).

bench/gpu_memory.py builds FastTargets one after another in one process, whose CUDA context has
loaded its kernels before the later plans measure it. A server plans right after loading, before
any kernel of the fast path is loaded, so it measures a smaller context and its warm-up adds the
difference (server.fast_memory.settle_after_warmup takes it from the prefix cache's budget). This
measures what a user gets: for each context, a new process places the model on the GPU as the
server's loader does (server.model_loading.place_on_device: a decoder layer at a time, quantized
there, the per-layer table left on the host) and builds the Engine as the server does (random-init
E4B shape, quanto int4, `EngineConfig(gpu_memory_mb=..., fast_max_context=context,
lm_head=...)`), then prefills a prompt of the context's length less 65 tokens and decodes 64,
polling the device's used memory every 2 ms (what nvidia-smi shows) from before the engine is
built. Records the start-up and serving peaks, the engine's notes (the plan, the LM head, what the
CUDA context grew by) and the served context.

Usage (GPU machine): python -m bench.gpu_engine_memory [--cap-mib 5120] [--contexts 8192,32768]
                                                       [--lm-head auto] [--out DIR]
Writes DIR/gpu_engine_memory.json and .md (default bench/results/).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30
GEN = 64


def one(cap_mib: float, context: int, lm_head: str) -> dict:
    """In this (fresh) process: build the engine under the cap, serve one long prompt, measure."""
    import torch

    from bench.gpu_e4b import build_model, random_e4b_target
    from bench.gpu_memory import UsedMemory
    from server.cuda_allocator import configure_cuda_allocator
    from server.engine import Engine, EngineConfig, GenerationParams

    configure_cuda_allocator([])  # as server.model_loading does, before any weight reaches the card
    from server.model_loading import place_on_device

    model = build_model(quant=False, on_host=True)  # what from_pretrained gives the loader
    used = UsedMemory()
    t = time.perf_counter()
    place_on_device(model, torch.device("cuda"), "int4")  # as the server's loader does
    after_load = used.now() / GIB
    load_peak = used.peak / GIB
    load_s = time.perf_counter() - t

    target = random_e4b_target(model)
    t = time.perf_counter()
    engine = Engine(target, None, EngineConfig(gpu_memory_mb=cap_mib, fast_max_context=context, lm_head=lm_head))
    r = {"context_asked": context, "lm_head": lm_head, "after_load_GiB": after_load, "load_peak_GiB": load_peak,
         "place_s": load_s,
         "engine_build_s": time.perf_counter() - t, "engine_notes": engine.notes,
         "context_served": engine.max_context, "startup_peak_GiB": used.peak / GIB, "warm_GiB": used.now() / GIB}
    used.reset()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (min(context, engine.max_context) - GEN - 1,), generator=g).tolist()
    t = time.perf_counter()
    tokens = sum(len(chunk.token_ids) for chunk in engine.generate(prompt, GenerationParams(max_tokens=GEN)))
    r.update(serve_s=time.perf_counter() - t, prompt_tokens=len(prompt), generated=tokens,
             serving_peak_GiB=used.peak / GIB, max_reserved_GiB=torch.cuda.max_memory_reserved() / GIB)
    used.stop()
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_engine_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--cap-mib", type=float, default=5120)
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--lm-head", default="auto", choices=("auto", "bf16", "int8"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: this context only
    args = ap.parse_args(argv)
    if args.one is not None:
        print("RESULT " + json.dumps(one(args.cap_mib, args.one, args.lm_head)), flush=True)
        return 0
    import torch

    runs = []
    for context in (int(c) for c in args.contexts.split(",")):
        child = subprocess.run([sys.executable, "-m", "bench.gpu_engine_memory", "--one", str(context),
                                "--cap-mib", str(args.cap_mib), "--lm-head", args.lm_head],
                               capture_output=True, text=True)
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if child.returncode or not lines:
            raise SystemExit(f"context {context}: the child failed\n{child.stdout[-3000:]}\n{child.stderr[-3000:]}")
        runs.append(json.loads(lines[-1][len("RESULT "):]))
        print(json.dumps(runs[-1], indent=1), flush=True)
    r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cap_MiB": args.cap_mib,
         "command": "python -m bench.gpu_engine_memory" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
         "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_engine_memory.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / "gpu_engine_memory.md").write_text(markdown(r))
    print(markdown(r))
    return 0


def markdown(r: dict) -> str:
    lines = [f"# The engine's GPU memory under --gpu-memory-mb {r['cap_MiB']:.0f}, a fresh process per context "
             f"({r['device']}, torch {r['torch']})", "",
             f"Command: `{r['command']}`. Device used = what nvidia-smi shows (the CUDA context included), "
             "polled every 2 ms.", "",
             "| context asked | served | LM head | peak while loading GiB | start-up peak GiB | serving peak GiB | prefill + 64 tokens s |",
             "|---|---|---|---|---|---|---|"]
    for x in r["runs"]:
        lines.append(f"| {x['context_asked']} | {x['context_served']} | {x['lm_head']} | {x.get('load_peak_GiB', float('nan')):.2f} | "
                     f"{x['startup_peak_GiB']:.2f} | "
                     f"**{x['serving_peak_GiB']:.2f}** | {x['serve_s']:.1f} |")
    lines += ["", "Engine notes on memory:", ""]
    for x in r["runs"]:
        lines += [f"- {x['context_asked']}: " + " / ".join(n for n in x["engine_notes"]
                                                       if "GiB" in n and ("fast path" in n or "GPU memory" in n))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
