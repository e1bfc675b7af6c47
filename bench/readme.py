"""Copy the latest benchmark tables into README.md: `python -m bench.readme`.

Replaces everything between the README's `<!-- results -->` and `<!-- /results -->` markers with the
Markdown that the benchmarks wrote under bench/results/ (SECTIONS), each under the command that
produced it, so the README's numbers are always the files' numbers; and writes docs/gpu_history.md
the same way from HISTORY (earlier runs and sweeps the README's current tables replaced).
"""
from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path("bench/results")
SECTIONS = [
    ("Agent sessions on the GPU: Gemma 4 E4B shape, int4, prefix cache (H200)",
     "python -m bench.gpu_sessions (on the GPU machine)", "gpu_sessions.md", []),
    ("Agent sessions through the server, bundled model, CPU", "python -m bench.agent_sessions",
     "agent_sessions.md", ["agent_sessions.png"]),
    ("Tokenizing an agent's prompts turn after turn: whole, and reusing the turn before (real sessions, CPU)",
     "python -m bench.prompt_tokens", "prompt_tokens.md", []),
    ("Hostile input: the fuzzer against the real server, bundled model, CPU", "make fuzz", "fuzz.md", []),
    ("Drafter and index (issue bars: tau vs prompt lookup and SuffixDecoding, latency, build speed, size, load time)",
     "python -m bench.ngram_bench", "ngram.md", []),
    ("Drafters on long agent conversations (whole-context search, SuffixDecoding at its best settings)",
     "python -m bench.long_context", "long_context.md", []),
    ("The same, the held-out test half (the drafter's settings were tuned on the dev half)",
     "python -m bench.long_context --split test", "long_context-test.md", []),
    ("The same, 32 tokens per verify, the held-out test half",
     "python -m bench.long_context --split test --max-draft 32", "long_context-32-test.md", []),
    ("The CPU int8 path against llama.cpp, bundled model, 2 threads",
     "python -m bench.cpu_path --requests 10 --llama-server PATH", "cpu_path.md", []),
    ("A CPU int8 forward, by part: a step and a verify", "python -m bench.cpu_step", "cpu_step.md", []),
    ("Several streams at once, bundled model, CPU, against llama.cpp's server with as many parallel slots",
     "python -m bench.concurrency --llama-server PATH", "concurrency.md", []),
    ("The same as agents' next turns (the conversation in each lane's prefix cache, 64 new tokens), drafts "
     "capped as the server caps them: 16 rows a forward for one or two streams, 32 for more (H200, 12-04, the "
     "Gluon step matmul with its codes unpacked two at a time)",
     "python -m bench.gpu_concurrency --turn 64 --rows auto --rounds 2 --no-costs (on the GPU machine)",
     "gpu_concurrency-rowsauto-turn64.md", []),
    ("The same on the code of 12-07, 1, 4 and 16 streams, the server's draft caps (H100, 12-07: one stream "
     "788 tokens/s, 4 streams 2.67x, 16 streams 3.58x)",
     "python -m bench.gpu_concurrency --streams 1,4,16 --turn 64 --rows auto (on the GPU machine)",
     "gpu_concurrency-stop64-h100.md", []),
    ("... and again after a lone stream's forwards got faster (x through L1, stop 65; H100, 12-07 evening: one "
     "stream 794 tokens/s, 4 streams 2.56x with p50 1.52x solo, 16 streams 3.50x)",
     "python -m bench.gpu_concurrency --streams 1,4,16 --turn 64 --rows auto --rounds 2 --no-costs (on the GPU machine)",
     "gpu_concurrency-stop68-h100.md", []),
    ("The same, 1 and 4 streams, the per-layer table read by the GPU in place (mapped: server/host_rows.py; "
     "H200, 12-04 night)",
     "python -m bench.gpu_concurrency --ple host --streams 1,4 --turn 64 --rows auto --rounds 2 --no-costs "
     "(on the GPU machine)", "gpu_concurrency-streams14-turn64-mapped.md", []),
    ("... and in the same sitting with its rows staged (gathered on the host, copied before each replay)",
     "python -m bench.gpu_concurrency --ple staged --streams 1,4 --turn 64 --rows auto --rounds 2 --no-costs "
     "(on the GPU machine)", "gpu_concurrency-streams14-turn64-staged.md", []),
    ("1 and 16 streams, the table mapped: 16 streams lose (so the engine stages lanes' rows), though one "
     "forward of 16 lanes alone is faster (H200, 12-04 night)",
     "python -m bench.gpu_concurrency --ple host --streams 1,16 --turn 64 --rows auto --rounds 1 "
     "(on the GPU machine)", "gpu_concurrency-streams116-turn64-mapped.md", []),
    ("... and in the same sitting with its rows staged",
     "python -m bench.gpu_concurrency --ple staged --streams 1,16 --turn 64 --rows auto --rounds 1 "
     "(on the GPU machine)", "gpu_concurrency-streams116-turn64-staged.md", []),
    ("Sailfish against its peers on the bundled model, CPU", "make bench", "bench.md",
     ["bench-tokens.png", "bench-tau.png", "bench-matrix.png"]),
    ("Sampled decoding, drafted vs plain with the same seeds, bundled model, CPU int8 path",
     "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python -m bench --sampled-only --full", "bench-sampled.md", []),
    ("Constrained decoding: grammar cost per token (llguidance, Gemma's 262k vocabulary)",
     "python -m bench.grammar_cost", "grammar_cost.md", []),
    ("The learning loop: distillation, and serve / rebuild / reload", "python -m bench.learning", "learning.md", []),
    ("The production shape on a GPU: Gemma 4 E4B, random init, int4 (H200)", "python -m bench.gpu_e4b (on the GPU machine)",
     "gpu_e4b.md", []),
    ("The step kernels against tinygemm/cuBLAS, per E4B layer shape (H200)",
     "python -m bench.small_m_bench (on the GPU machine)", "small_m.md", []),
    ("The GPU verify cost curve to 64 tokens (E4B shape, int4, H200)",
     "python -m bench.gpu_cost_curve (on the GPU machine)", "gpu_cost_curve.md", []),
    ("The server's engine under a 5 GiB cap, a fresh process per context: E4B shape at 8k and 32k (H200)",
     "python -m bench.gpu_engine_memory (on the GPU machine)", "gpu_engine_memory.md", []),
    ("GPU memory under a 5 GiB cap that counts the CUDA context: E4B shape at 8k and 32k context, bf16 "
     "and int8 LM head (H200)",
     "python -m bench.gpu_memory --lm-head bf16,auto (on the GPU machine)", "gpu_memory-head-bf16-auto.md", []),
    ("The int8 LM head's cost in quality, on a real Gemma (bundled model, CPU)",
     "python -m bench.lm_head_quality", "lm_head_quality.md", []),
    ("The fast-path step as it stands: the step's norms on kernels of their own (server/step_norms.py) against "
     "the compiled ops; the kernels a step launches and where its GPU time goes (E4B shape, int4, H100, 12-06)",
     "python -m bench.step_ab --base-tree . --base-set server.fast_path.RESIDUAL_NORM_KERNEL=False --base-set "
     "server.fast_path.QKV_NORM_KERNEL=False --head-set server.fast_path.RESIDUAL_NORM_KERNEL=True --head-set "
     "server.fast_path.QKV_NORM_KERNEL=True --rounds 1 (on the GPU machine)", "step_ab-norm-kernels-h100.md", []),
    ("The engine's drought rule: a drafting request's plain steps chained on the device (E4B shape, int4, H100)",
     "python -m bench.drought_ab --rounds 2 (on the GPU machine)", "drought_ab-h100.md", []),
    ("What the split-K sums cost a chain of E4B's int4 matmuls (H200)",
     "python -m bench.small_m_bench --chain-tails (on the GPU machine)", "small_m_chain-tails.md", []),
    ("E4B's int4 step matmuls one launch at a time under Nsight Compute: what the SMs do (H200, 12-06)",
     "ncu --clock-control none --kernel-name regex:int4_step --section SpeedOfLight --section Occupancy "
     "--section SchedulerStats --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis "
     "--csv --page details python -m bench.step_matmul_profile --drive > ncu.csv (on the GPU machine), then "
     "python -m bench.step_matmul_profile --report ncu.csv", "step_matmul_profile-h200.md", []),
    ("Projected E4B tokens/s per workload, from replay tau and the GPU step times", "python -m bench.project_gpu",
     "gpu_projection.md", []),
]
# Earlier runs the README's tables replaced, and configurations tried and dropped: docs/gpu_history.md
HISTORY = [
    ("The fast-path step, plain greedy steps chained on the device, the step's token embedding gathered and its "
     "logits soft-capped in the LM head's store (E4B shape, int4, H100, 12-06, before the step's norm kernels)",
     "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab-chained-h100.md", []),
    ("The fast-path step, the per-layer table read by the GPU in place inside the step's graph (E4B shape, "
     "int4, H200)", "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab-hosttables.md", []),
    ("The fast-path step, each layer's K/V write in its step attention's launch (E4B shape, int4, H200)",
     "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab-kvwrite.md", []),
    ("Several streams as agents' next turns, 1 and 4 streams (H200, 12-04 evening: the batcher's waiting lanes "
     "sleep instead of polling, and the gelus run in the step matmuls' epilogues)",
     "python -m bench.gpu_concurrency --streams 1,4 --turn 64 --rows auto --rounds 2 --no-costs (on the GPU machine)",
     "gpu_concurrency-streams14-turn64.md", []),
    ("Several streams at once on the GPU fast path's lanes, E4B shape (H200; measured 12-02, before next turns' prompts ran as steps)",
     "python -m bench.gpu_concurrency --rounds 2 (on the GPU machine)", "gpu_concurrency.md", []),
    ("The same with 16 rows a forward at every count (the server's rule before 12-03; H200, 12-03, the same "
     "sitting as a --rows 32 run: bench/results/gpu_concurrency-rows32-turn64.md)",
     "python -m bench.gpu_concurrency --turn 64 --rows 16 --rounds 2 --no-costs (on the GPU machine)",
     "gpu_concurrency-rows16-turn64.md", []),
    ("GPU memory with one int4 layout, before the int8 head and before the cap counted the CUDA context (H200)",
     "python -m bench.gpu_memory (on the GPU machine, an earlier build)`; the old configuration beside it:\n"
     "`python -m bench.gpu_memory --allocator default --buckets all --contexts 32768", "gpu_memory.md", []),
    ("The fast-path step, the Gluon matmul's first weights copied before its programmatic-dependent-launch wait "
     "(E4B shape, int4, H200)",
     "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab-prefetch.md", []),
    ("The weight prefetch on a chain of E4B's int4 matmuls, cold weights (H200)",
     "python -m bench.small_m_bench --chain (on the GPU machine)", "small_m_chain.md", []),
    ("The fast-path step, the gelus in the epilogues of the matmuls they read (E4B shape, int4, H200)",
     "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab-gelu.md", []),
    ("The gelu epilogues per linear, cold weights, E4B int4 shapes (H200)",
     "python -m bench.small_m_bench --epilogues (on the GPU machine)", "small_m_epilogues.md", []),
    ("The fast-path step, the Gluon int4 step matmul decoding two weights with one byte permute and one LOP3 "
     "(E4B shape, int4, H200)",
     "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab-decode.md", []),
    ("The fast-path step, the int4 step matmul in Gluon (server/gluon_matmul.py) against the Triton kernel "
     "(E4B shape, int4, H200)",
     "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab-gluon.md", []),
    ("The fast-path step, the small-M kernel's int4 groups in their own accumulators (E4B shape, int4, H200)",
     "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab.md", []),
    ("The step kernel's configurations on cold weights, E4B int4 shapes, Gluon and Triton kernels (H200)",
     "python -m bench.small_m_bench --cold (on the GPU machine)", "small_m_cold.md", []),
    ("The fast-path step, one step-attention launch a layer instead of two (E4B shape, int4, H200)",
     "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab-attention.md", []),
    ("The fast-path step, before and after fusing its norm kernels (E4B shape, int4, H200)",
     "python -m bench.step_ab --base REV (on the GPU machine)", "step_ab-norms.md", []),
]


def section(sections=SECTIONS, images_from: str = "bench/results") -> str:
    parts = []
    for title, command, name, charts in sections:
        path = RESULTS / name
        if not path.exists():
            continue
        body = path.read_text().strip()
        body = re.sub(r"^# .*\n+", "", body)  # the file's own title, if any
        body = re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + 3) + " ", body, flags=re.M)
        images = "\n".join(f"![{c}]({images_from}/{c})" for c in charts if (RESULTS / c).exists())
        parts.append(f"### {title}\n\n`{command}`\n\n{body}\n" + (f"\n{images}\n" if images else ""))
    return "\n".join(parts)


def main() -> int:
    readme = Path("README.md")
    text = readme.read_text()
    start, end = "<!-- results -->", "<!-- /results -->"
    if start not in text or end not in text:
        raise SystemExit("README.md has no <!-- results --> ... <!-- /results --> section")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{section()}\n{end}{tail}")
    Path("docs/gpu_history.md").write_text(
        "# Earlier GPU runs\n\nWritten by `python -m bench.readme` from bench/results/: the step A/Bs and "
        "configuration sweeps whose results the README's current tables replaced or built on, and the earlier "
        "sittings of the concurrency and memory benchmarks, each under the command that produced it. "
        "docs/bars.md tells the story around them.\n\n" + section(HISTORY, "../bench/results") + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
