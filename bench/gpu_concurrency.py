"""Several streams at once on the GPU fast path's lanes: aggregate tokens/s, latency, identity.

    python -m bench.gpu_concurrency [--streams 1,2,4,8,16] [--tokens 128] [--prompt 1000] [--plain] [--out DIR]
                                                                                    (GPU machine)
    python -m bench.gpu_concurrency --tiny                                          (any machine: a smoke run)

Contract: builds the E4B shape (random init, quanto int4, the per-layer table on the host, as
bench.gpu_e4b builds it) and one FastTarget, then lanes for the largest stream count
(server/fast_batch.py, what `--parallel N` builds). First each stream's reference: its prompt (random
ids, `--prompt` tokens, a different one per stream) decoded alone on the first lane, greedy, plain.
Then for each count S, S threads each decode their own prompt on their own lane at once, greedy,
with oracle drafts (the stream's reference with 20% of the tokens wrong: bench.fast_greedy.oracle;
at most min(15, 64 / S - 1) tokens, so one forward of the step kernels' 64 rows carries every
stream's verify) or plainly (`--plain`), each ending in discard (the lane leaves the rendezvous).
Per count: wall time from the first thread's start to the last one's end (prefills included),
aggregate tokens/s = S x `--tokens` / wall, its ratio to one stream's, p50 of the streams' own
times and its ratio to one stream's, the forwards the lanes' batcher ran and the most streams one
carried, and whether every stream's tokens equal its reference. Issue bars (GPU, drafting on):
4 streams >= 3x one stream's tokens/s and p50 latency <= 1.5x; 16 streams >= 8x; identical always.
Writes DIR/gpu_concurrency.json and .md (default bench/results/); `--tiny` measures a tiny random
Gemma 4 on the CPU instead (uncaptured, fp32): it checks the harness, and its times mean nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def build(tiny: bool, max_len: int):
    """(a FastTarget, its model's vocabulary size)."""
    from server.fast_path import FastTarget

    if tiny:
        from bench.step_ab import _tiny_gemma4

        model = _tiny_gemma4()
        return FastTarget(model, max_len=max_len, prefill_chunk=32, capture=False, min_kv_len=64,
                          buckets=(2, 4, 8, 16)), model.config.vocab_size
    from bench.gpu_e4b import build_model

    model = build_model(quant=True)
    model.model.embed_tokens_per_layer.to("cpu")
    torch.cuda.empty_cache()
    fast = FastTarget(model, max_len=max_len, min_kv_len=1024, ple_on_host=True, buckets=(2, 4, 8, 16))
    fast.warmup()  # its graphs now, not inside the streams' threads (fast_lanes warms the other lanes)
    return fast, model.config.vocab_size


def decode(lane, prompt: list[int], tokens: int, propose=None, max_draft: int = 15) -> tuple[list[int], float]:
    """(greedy tokens, seconds) of one stream on one lane; the lane leaves the rendezvous at the end."""
    from bench.fast_greedy import greedy_generate

    t0 = time.perf_counter()
    try:
        out, _ = greedy_generate(lane, prompt, tokens, propose, max_draft=max_draft)
    finally:
        lane.discard()
    return out, time.perf_counter() - t0


def run_streams(lanes, prompts, references, tokens: int, plain: bool, vocab: int) -> dict:
    from bench.concurrency import run_at_once
    from bench.fast_greedy import oracle

    S = len(prompts)
    max_draft = min(15, 64 // S - 1)
    results: list = [None] * S
    errors: list = []
    before = dict(lanes[0].batcher.summary()) if lanes[0].batcher is not None else None

    def stream(i: int) -> None:
        try:
            propose = None if plain else oracle(references[i], len(prompts[i]), vocab=vocab, seed=i)
            results[i] = decode(lanes[i], prompts[i], tokens, propose, max_draft)
        except BaseException as e:  # reported, not swallowed
            errors.append(e)

    wall = run_at_once([lambda i=i: stream(i) for i in range(S)])
    if errors:
        raise errors[0]
    after = lanes[0].batcher.summary() if lanes[0].batcher is not None else None
    return {"streams": S, "max_draft": 0 if plain else max_draft, "wall_s": wall,
            "aggregate_tps": S * tokens / wall, "stream_s": [r[1] for r in results],
            "p50_s": statistics.median(r[1] for r in results),
            "identical": [r[0] == references[i] for i, r in enumerate(results)],
            "forwards": None if after is None else after["forwards"] - before["forwards"],
            "peak_streams": None if after is None else after["peak_sequences"]}


def markdown(r: dict) -> str:
    one = r["runs"][0]
    lines = ["# Several streams at once on the GPU fast path's lanes", "",
             f"{r['when']}, {r['machine']}, {r['device']}. Command: `{r['command']}`.", "",
             f"{r['model']}; prompts of {r['prompt']} random tokens, {r['tokens']} tokens a stream, greedy, "
             + ("plain." if r["plain"] else "oracle drafts (the stream's own output, 20% of tokens wrong)."), "",
             "| streams | max draft | aggregate tokens/s | x one stream | stream p50 (s) | p50 / one stream | "
             "forwards | most streams in one forward (so far) | identical to solo |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in r["runs"]:
        lines.append(f"| {run['streams']} | {run['max_draft']} | {run['aggregate_tps']:.1f} | "
                     f"{run['aggregate_tps'] / one['aggregate_tps']:.2f}x | {run['p50_s']:.2f} | "
                     f"{run['p50_s'] / one['p50_s']:.2f}x | {run['forwards']} | {run['peak_streams']} | "
                     f"{sum(run['identical'])}/{run['streams']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_concurrency", description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--plain", action="store_true", help="no drafts")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the harness only")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.tiny and args.streams == "1,2,4,8,16":
        args.streams, args.tokens, args.prompt = "1,2,4", 24, 40
    counts = [int(c) for c in args.streams.split(",")]
    from bench.results import run_header, write_results
    from server.fast_batch import fast_lanes

    fast, vocab = build(args.tiny, args.prompt + args.tokens + 64)
    lanes = fast_lanes(fast, max(counts))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt,), generator=g).tolist() for _ in range(max(counts))]
    references = [decode(lanes[0], p, args.tokens)[0] for p in prompts]
    runs = [run_streams(lanes[:S], prompts[:S], references[:S], args.tokens, args.plain, vocab) for S in counts]
    device = "CPU (tiny model)" if args.tiny else torch.cuda.get_device_name()
    r = {**run_header(), "command": "python -m bench.gpu_concurrency" + "".join(f" {a}" for a in argv),
         "device": device, "model": "a tiny random Gemma 4, fp32, uncaptured" if args.tiny else
         "E4B shape, random init, int4, per-layer table on the host", "prompt": args.prompt, "tokens": args.tokens,
         "plain": args.plain, "runs": runs}
    md = markdown(r)
    write_results(args.out, "gpu_concurrency" + ("-tiny" if args.tiny else ""), r, md)
    print(md)
    return 0 if all(all(run["identical"]) for run in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
