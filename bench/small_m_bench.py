"""The small-M matmul (server/small_m_matmul.py) against tinygemm on the E4B layer shapes (GPU).

For every linear layer shape of one E4B decoder layer (and the LM head: bf16, and the int8 one of
`--lm-head int8` against the bf16 one on cuBLAS), on random quanto int4 weights: relative error against the dequantized weight's bf16 product, bit-identity of row 0 between
1-row and 16-row products (batch invariance), and kernel time for 1 and 16 rows (CUDA events over a
CUDA graph of 50 calls, median of 7). Usage: python -m bench.small_m_bench [--out DIR]
Writes DIR/small_m.json and DIR/small_m.md (default bench/results/).

`--cold`: the step kernel's configurations (COLD_CONFIGS: kernel, K-slice target, pipeline stages,
column tile, warps) timed as a decode step
meets its weights, cold: each call reads a different copy of the weight, the copies together past
the GPU's L2 cache (a hot loop over one weight would time the cache, not the memory). Per E4B int4
shape and summed per forward, for 1, 16, 32 and 64 rows, against each shape's weight-bytes floor at the
memory's peak rate. Writes DIR/small_m_cold.json and .md.

`--epilogues`: the linears a gelu reads (gate|up, the per-layer input gate), cold, at those row counts:
alone, followed by the compiled gelu kernel, and with the gelu in their epilogue; whether the fused
output has the unfused bits. Writes DIR/small_m_epilogues.json and .md.

`--chain`: the Gluon kernel's weight prefetch before its programmatic-dependent-launch wait
(server/gluon_matmul.py PREFETCH) off and on, over a chain of one layer's int4 matmuls x 42 layers.
Writes DIR/small_m_chain.json and .md. `--chain-tails`: the same chain with the split-K sums left
out (each K slice stores its partial and ends: SmallMLinear.reduce) and in, so the difference is
what the sums cost; writes DIR/small_m_chain-tails.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.results import write_results
from server.small_m_matmul import SmallMLinear, share_partials

# (name, N, K, count per forward) for the E4B text config: 35 sliding layers (head_dim 256), 7 full (512).
SHAPES = [
    ("qkv sliding", 3072, 2560, 35), ("qkv full", 6144, 2560, 7),
    ("o sliding", 2560, 2048, 35), ("o full", 2560, 4096, 7),
    ("gate|up", 20480, 2560, 42), ("down", 2560, 10240, 42),
    ("ple gate", 256, 2560, 42), ("ple proj", 2560, 256, 42), ("ple model proj", 10752, 2560, 1),
]
LM_HEAD = ("lm head (bf16)", 262144, 2560, 1)
# The int8 head the planner picks under --gpu-memory-mb (server.small_m_matmul.quantize_int8), instead
# of the bf16 one: not counted in the per-forward sums; its baseline is the bf16 head on cuBLAS.
LM_HEAD_INT8 = ("lm head (int8, under a cap)", 262144, 2560, 0)


def int4_linear(n: int, k: int):
    from optimum.quanto import freeze, qint4, quantize
    holder = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    quantize(holder, weights=qint4)  # quanto swaps a module's children, not the module itself
    freeze(holder)
    lin = holder[0]
    from server.fast_linears import Int4Linear, as_linear
    fast = as_linear(lin)
    if not isinstance(fast, Int4Linear):
        raise RuntimeError(f"quanto did not give a tinygemm int4 weight ({type(lin.qweight).__name__})")
    return lin.qweight, fast.packed, fast.scale_shift, fast.group_size


def graph_time_us(fn, calls: int = 50, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(times)


def measure(name, n, k, count, dense: bool, configs, int8: bool = False) -> dict:
    torch.manual_seed(0)
    x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    x1 = x16[:1].clone()
    if dense:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ref_w = weight
        base = lambda x: torch.nn.functional.linear(x, weight)
        make = lambda **kw: SmallMLinear.from_dense(weight, **kw)
        if int8:  # the same weight quantized; the reference is what the kernel multiplies by
            from server.small_m_matmul import quantize_int8
            q = quantize_int8(weight)
            ref_w = q.dequantize()
            make = lambda **kw: SmallMLinear(q.weight, q.scale, None, n, k, **kw)
    else:
        qw, packed, scale_shift, group = int4_linear(n, k)
        ref_w = qw.dequantize()
        base = lambda x: torch._weight_int4pack_mm(x, packed, group, scale_shift)
        make = lambda **kw: SmallMLinear.from_int4(packed, scale_shift, group, n, k, **kw)
    ref = (x16.float() @ ref_w.float().t())
    row = {"name": name, "n": n, "k": k, "count": count,
           "base_us_1": graph_time_us(lambda: base(x1)), "base_us_16": graph_time_us(lambda: base(x16))}
    base_out = base(x16).float()
    row["base_rel_err"] = ((base_out - ref).norm() / ref.norm()).item()
    row["base_invariant"] = bool(torch.equal(base(x1)[0], base(x16)[0]))
    best = None
    for block_n, warps, stages, target, magic in configs:
        if n % block_n:
            continue
        lin = make(block_n=block_n, num_warps=warps, num_stages=stages, target_programs=target, magic=magic)
        out16 = lin(x16)
        cand = {"block_n": block_n, "warps": warps, "stages": stages, "target": target, "magic": magic, "split": lin.split,
                "rel_err": ((out16.float() - ref).norm() / ref.norm()).item(),
                "invariant": bool(torch.equal(lin(x1)[0], out16[0])) and bool(torch.equal(lin(x16[:5])[3], out16[3])),
                "us_1": graph_time_us(lambda: lin(x1)), "us_16": graph_time_us(lambda: lin(x16))}
        row.setdefault("configs", []).append(cand)
        if best is None or cand["us_16"] + cand["us_1"] < best["us_16"] + best["us_1"]:
            best = cand
    row["best"] = best
    print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
    return row


# (name, head_dim, cache slots, sliding, context): E4B's full layers (the cache of a 8704-token
# server) and sliding layers (a ring of window 512 + chunk 512).
ATTENTION = [("full", 512, 8704, False, 1024), ("full", 512, 8704, False, 8192), ("sliding", 256, 1024, True, 1024),
             ("sliding", 256, 1024, True, 8192)]


def measure_attention(name, head_dim, slots, sliding, context) -> list:
    from server.fast_ops import _EAGER_OPS, _attention, _masks
    from server.step_attention import StepAttention
    torch.manual_seed(0)
    kvh, group, window = 2, 4, 512
    kc = torch.randn(kvh, slots, head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    slot_pos = torch.full((slots,), -1, dtype=torch.long, device="cuda")
    if sliding:
        span = torch.arange(max(0, context + 16 - slots), context + 16, device="cuda")
        slot_pos[span % slots] = span
    att = StepAttention(kvh, group, head_dim, slots, 16, "cuda")
    out = []
    for T in (1, 16):
        qpos = torch.arange(context, context + T, device="cuda")
        q = torch.randn(T, kvh * group, head_dim, device="cuda", dtype=torch.bfloat16)
        sm, fm = _masks(slot_pos, torch.arange(slots, device="cuda"), qpos, window)
        mask = sm if sliding else fm
        ours = lambda: att(q, kc, vc, slots, qpos, slot_pos if sliding else None, window, 1.0)
        base = lambda: _attention(q, kc, vc, mask, 1.0, _EAGER_OPS.masked_softmax)
        ref = _attention(q.float(), kc.float(), vc.float(), mask, 1.0, _EAGER_OPS.masked_softmax)
        o, b = ours().float(), base().float()
        one = att(q[-1:], kc, vc, slots, qpos[-1:], slot_pos if sliding else None, window, 1.0)
        base_one = _attention(q[-1:], kc, vc, mask[-1:], 1.0, _EAGER_OPS.masked_softmax)
        row = {"name": name, "context": context, "T": T, "torch_us": graph_time_us(base), "ours_us": graph_time_us(ours),
               "rel_err": ((o - ref).norm() / ref.norm()).item(), "torch_rel_err": ((b - ref).norm() / ref.norm()).item(),
               "invariant": bool(torch.equal(one[0], ours()[-1])), "torch_invariant": bool(torch.equal(base_one[0], base()[-1]))}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


# Step kernel configurations: kernel (server/gluon_matmul.py's, or gpu_kernels.py's Triton
# `_small_m_kernel`), K-slice target (programs), pipeline stages (the Triton kernel's
# num_stages; the Gluon kernel's ring of groups), column tile, warps; the first is the shipped one. (Two other int4
# variants, scales applied after the products and a group decoded as one tile, were measured slower
# at e458c5f: bench/results/small_m_cold-variants.md.)
# "same_split": the K slices of the first configuration (its sums, hence its bits) on another tiling.
COLD_CONFIGS = [
    {"kernel": "gluon", "target": 264, "stages": 2, "block_n": 64, "warps": 4},
    {"kernel": "gluon", "target": 528, "stages": 2, "block_n": 64, "warps": 4},
    {"kernel": "gluon", "target": 1056, "stages": 2, "block_n": 64, "warps": 4},
    {"kernel": "gluon", "target": 264, "stages": 3, "block_n": 64, "warps": 4},
    {"kernel": "gluon", "target": 264, "stages": 4, "block_n": 64, "warps": 4},
    {"kernel": "gluon", "target": 264, "stages": 2, "block_n": 64, "warps": 2},
    {"kernel": "gluon", "target": 264, "stages": 2, "block_n": 128, "warps": 4, "same_split": True},
    {"kernel": "gluon", "target": 264, "stages": 2, "block_n": 128, "warps": 8, "same_split": True},
    {"kernel": "triton", "target": 264, "stages": 3, "block_n": 64, "warps": 4},
]
COLD_ROWS = (1, 16, 32, 64)
COLD_BYTES = 512 << 20   # the copies of one shape's weight: ~10x the H200's 50 MB L2
PEAK_BYTES_PER_S = 4.0e12  # the floor's rate: ~H200's 4.8 TB/s at the ~85% a streaming read reaches


def config_name(c: dict) -> str:
    if c["kernel"] == "gluon":
        split = " (its K slices)" if c.get("same_split") else ""
        return f"gluon t{c['target']} s{c['stages']} n{c['block_n']} w{c['warps']}{split}"
    return f"triton t{c['target']} s{c['stages']} n{c['block_n']} w{c['warps']}"


def random_int4_copies(n: int, k: int, copies: int) -> list[tuple]:
    """`copies` random int4 weights (codes in the step layout, bf16 scales and offsets) of one shape."""
    from server.small_m_matmul import pack_codes
    out = []
    for c in range(copies):
        g = torch.Generator(device="cuda").manual_seed(c)
        codes = torch.randint(0, 16, (n, k), device="cuda", generator=g)
        scale = (torch.rand(k // 128, n, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
        offset = (-8 * scale.float() + torch.randn(k // 128, n, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
        out.append((pack_codes(codes), scale, offset))
    return out


def cold_time_us(lins: list, x: torch.Tensor, reps: int = 7) -> float:
    """Per-call time of a CUDA graph that calls each linear once, in turn (each a cold weight)."""
    return graph_time_us(lambda: [lin(x) for lin in lins], calls=1, reps=reps) / len(lins)


def measure_cold(name, n, k, count, configs) -> dict:
    weight_bytes = n * k // 2 + 2 * 2 * (k // 128) * n
    copies = max(2, min(64, COLD_BYTES // weight_bytes))
    weights = random_int4_copies(n, k, copies)
    x64 = torch.randn(max(COLD_ROWS), k, device="cuda", dtype=torch.bfloat16)
    w, s, o = weights[0]
    ref = x64.float() @ SmallMLinear(w, s, o, n, k).dequantize().float().t()
    row = {"name": name, "n": n, "k": k, "count": count, "copies": copies, "weight_bytes": weight_bytes,
           "floor_us": weight_bytes / PEAK_BYTES_PER_S * 1e6, "configs": []}
    for c in configs:
        if n % c["block_n"]:
            row["configs"].append(dict(c, split=0, invariant=True, rel_err=0.0,
                                       **{f"us_{m}": float("nan") for m in COLD_ROWS}))
            continue
        split = row["configs"][0]["split"] if c.get("same_split") and row["configs"] else None
        lins = [SmallMLinear(w, s, o, n, k, block_n=c["block_n"], num_warps=c["warps"], num_stages=c["stages"],
                             target_programs=c["target"], split=split, gluon_stages=c["stages"])
                for w, s, o in weights]
        if c["kernel"] == "gluon" and not lins[0].gluon:
            raise RuntimeError("server/gluon_matmul.py's kernel does not run here")
        for lin in lins:
            lin.gluon = c["kernel"] == "gluon"
        share_partials(lins)  # one split-K scratch, as a model's linears share it
        out64 = lins[0](x64)
        cand = dict(c, split=lins[0].split,
                    invariant=all(torch.equal(lins[0](x64[:m])[m - 1], out64[m - 1]) for m in (1, 2, 5, 17, 33)),
                    rel_err=((out64.float() - ref).norm() / ref.norm()).item(),
                    **{f"us_{m}": cold_time_us(lins, x64[:m]) for m in COLD_ROWS})
        if not row["configs"]:
            first64 = out64
        elif row["configs"][0]["split"] == cand["split"]:   # same K slices: the same sums expected
            cand["bits_of_first"] = torch.equal(out64, first64)
        row["configs"].append(cand)
        del lins
    print(json.dumps(row), flush=True)
    return row


def main_cold(out: Path) -> int:
    import math
    rows = [measure_cold(*shape, COLD_CONFIGS) for shape in SHAPES]

    def forward_ms(pick) -> dict:
        return {m: sum(pick(r)[f"us_{m}"] * r["count"] for r in rows) / 1e3 for m in COLD_ROWS}

    usable = lambda r: [c for c in r["configs"] if not math.isnan(c["us_1"])]
    per_forward = {config_name(c): forward_ms(lambda r, i=i: r["configs"][i]) for i, c in enumerate(COLD_CONFIGS)
                   if all(not math.isnan(r["configs"][i]["us_1"]) for r in rows)}
    best = forward_ms(lambda r: min(usable(r), key=lambda c: sum(c[f"us_{m}"] for m in COLD_ROWS)))
    floor = sum(r["floor_us"] * r["count"] for r in rows) / 1e3
    results = {"device": torch.cuda.get_device_name(), "configs": COLD_CONFIGS, "rows": rows,
               "per_forward_ms": per_forward, "best_per_shape_ms": best, "floor_ms": floor,
               "peak_bytes_per_s": PEAK_BYTES_PER_S}
    lines = [f"# Step matmul configurations, cold weights, E4B int4 shapes ({results['device']})", "",
             "Each cell: microseconds per call for " + " / ".join(f"{m}" for m in COLD_ROWS) + " rows. "
             "Configurations: the kernel (gluon: server/gluon_matmul.py; triton: `_small_m_kernel`), t the K-slice "
             "target (programs), s pipeline stages, n the column tile, w warps. The first is the shipped "
             "configuration. Same bits: every configuration with the first one's K slices gave its output bit "
             "for bit.", "",
             "| layer | N | K | x/forward | floor us | " + " | ".join(config_name(c) for c in COLD_CONFIGS)
             + " | row-invariant | same bits | max rel err |",
             "|---|---|---|---|---|" + "---|" * len(COLD_CONFIGS) + "---|---|---|"]
    for r in rows:
        cells = " | ".join("-" if math.isnan(c["us_1"]) else " / ".join(f"{c[f'us_{m}']:.1f}" for m in COLD_ROWS)
                           for c in r["configs"])
        same = all(c.get("bits_of_first", True) for c in r["configs"])
        lines.append(f"| {r['name']} | {r['n']} | {r['k']} | {r['count']} | {r['floor_us']:.1f} | {cells} | "
                     f"{all(c['invariant'] for c in r['configs'])} | {same} | "
                     f"{max(c['rel_err'] for c in r['configs']):.1e} |")
    lines += ["", f"Per forward (sum over the 42 layers' linears; the LM head is not int4): floor {floor:.2f} ms "
              f"at {PEAK_BYTES_PER_S / 1e12:.1f} TB/s; "
              + "; ".join(f"{name} " + " / ".join(f"{v[m]:.2f}" for m in COLD_ROWS) + " ms"
                          for name, v in per_forward.items())
              + "; the fastest configuration per shape " + " / ".join(f"{best[m]:.2f}" for m in COLD_ROWS)
              + " ms (" + " / ".join(f"{m}" for m in COLD_ROWS) + " rows)."]
    md = "\n".join(lines) + "\n"
    write_results(out, "small_m_cold", results, md)
    print(md)
    return 0


# The linears whose output a gelu reads (server/small_m_matmul.py GELU_PAIRS / GELU_TIMES), per E4B layer
EPILOGUE_SHAPES = [("gate|up, gelu(gate) * up", 20480, 2560, 42, "pairs"),
                   ("ple gate, gelu(y) * ple", 256, 2560, 42, "times")]


def measure_epilogue(name, n, k, count, kind) -> dict:
    """One shape on cold weights: the matmul alone, the matmul then the fast path's compiled gelu_mul
    kernel (two launches, as steps ran before the epilogues), and the fused launch; and whether the
    fused output is the unfused one's bits."""
    from server.fast_ops import _compiled_ops

    gelu_mul = _compiled_ops().gelu_mul
    weight_bytes = n * k // 2 + 2 * 2 * (k // 128) * n
    lins = [SmallMLinear(w, s, o, n, k) for w, s, o in
            random_int4_copies(n, k, max(2, min(64, COLD_BYTES // weight_bytes)))]
    fused = [lin.gelu_pairs() for lin in lins] if kind == "pairs" else lins
    share_partials(lins + fused)
    x64 = torch.randn(max(COLD_ROWS), k, device="cuda", dtype=torch.bfloat16)
    u64 = torch.randn(max(COLD_ROWS), 3, n, device="cuda", dtype=torch.bfloat16)[:, 1]  # strided, as ple[:, layer]
    row = {"name": name, "n": n, "k": k, "count": count, "kind": kind, "gluon": lins[0].gluon}
    for m in COLD_ROWS:
        x, u = x64[:m], u64[:m]
        if kind == "pairs":
            separate = lambda lin: gelu_mul(*lin(x).split(n // 2, -1))
            one = lambda lin, f: f(x)
        else:
            separate = lambda lin: gelu_mul(lin(x), u)
            one = lambda lin, f: lin(x, gelu_times=u)
        row[f"same_bits_{m}"] = all(torch.equal(one(lin, f), separate(lin)) for lin, f in zip(lins[:4], fused[:4]))
        per_call = lambda fn: graph_time_us(lambda: [fn(lin, f) for lin, f in zip(lins, fused)], calls=1) / len(lins)
        row[f"matmul_us_{m}"] = per_call(lambda lin, f: lin(x))
        row[f"separate_us_{m}"] = per_call(lambda lin, f: separate(lin))
        row[f"fused_us_{m}"] = per_call(one)
    print(json.dumps(row), flush=True)
    return row


def main_epilogues(out: Path) -> int:
    rows = [measure_epilogue(*shape) for shape in EPILOGUE_SHAPES]
    saved = {m: sum((r[f"separate_us_{m}"] - r[f"fused_us_{m}"]) * r["count"] for r in rows) / 1e3
             for m in COLD_ROWS}
    results = {"device": torch.cuda.get_device_name(), "rows": rows, "saved_per_forward_ms": saved}
    lines = [f"# The gelus in the step matmuls' epilogues, cold weights, E4B int4 shapes ({results['device']})", "",
             "Microseconds per call for " + " / ".join(f"{m}" for m in COLD_ROWS) + " rows (CUDA graphs, each call "
             "a different copy of the weight). separate: the matmul, then the compiled gelu_mul kernel (two "
             "launches, programmatic dependent launch between them); fused: one launch "
             "(server/small_m_matmul.py GELU_PAIRS / GELU_TIMES). Same bits: the fused output equals the "
             "separate one's, at every row count.", "",
             "| linear | N | K | x/forward | matmul alone | separate | fused | same bits |", "|---|---|---|---|---|---|---|---|"]
    cells = lambda r, key: " / ".join(f"{r[f'{key}_us_{m}']:.1f}" for m in COLD_ROWS)
    for r in rows:
        lines.append(f"| {r['name']} | {r['n']} | {r['k']} | {r['count']} | {cells(r, 'matmul')} | "
                     f"{cells(r, 'separate')} | {cells(r, 'fused')} | "
                     f"{all(r[f'same_bits_{m}'] for m in COLD_ROWS)} |")
    lines += ["", "Saved per forward (both linears, 42 layers): "
              + " / ".join(f"{saved[m]:.3f}" for m in COLD_ROWS) + " ms."]
    md = "\n".join(lines) + "\n"
    write_results(out, "small_m_epilogues", results, md)
    print(md)
    return 0


# One E4B layer's int4 matmuls in the order a step runs them, each reading the one before's output
CHAIN = [("qkv", 3072, 2560), ("o", 2560, 2048), ("gate|up", 20480, 2560), ("down", 2560, 10240),
         ("ple gate", 256, 2560), ("ple proj", 2560, 256)]
CHAIN_LAYERS = 42


# What `--chain` and `--chain-tails` switch, off then on: (what the setting is, the off and on labels, results' name)
CHAIN_SETTINGS = {
    "prefetch": ("off: each kernel waits for the one before it, then copies its first group; on: it copies the "
                 "group's weights first (server/gluon_matmul.py PREFETCH)", "off", "on", "small_m_chain"),
    "tails": ("no sum: each K slice stores its fp32 partial and its program ends (no counter, no fence, no "
              "summing program; the outputs are not written, so the chain's values are not the model's); "
              "shipped: the last slice of a column tile to arrive sums the partials (an acq_rel atomic, then "
              "the partials read back). The difference is what a split-K sum costs a chain: the bound on "
              "what summing the partials in the next kernel could save", "no sum", "shipped", "small_m_chain-tails"),
}


def main_chain(out: Path, setting: str = "prefetch", rounds: int = 5) -> int:
    """One setting (CHAIN_SETTINGS) off and on, in one process: CHAIN over 42 layers of cold weights (a
    copy per layer), each matmul's input the previous one's output (q's columns for o; gelu(gate) * up
    for down; gelu(gate) * u for ple proj), one CUDA graph per setting and row count, replayed
    alternately; ms a chain (median of `rounds`, range) and whether both settings give the same bits
    (prefetch only: without the sums the outputs are not written)."""
    from server import gluon_matmul

    lins = {name: [SmallMLinear(w, s, o, n, k) for w, s, o in random_int4_copies(n, k, CHAIN_LAYERS)]
            for name, n, k in CHAIN}
    pairs = [lin.gelu_pairs() for lin in lins["gate|up"]]
    every = [lin for group in lins.values() for lin in group] + pairs
    share_partials(every)

    def chain(x, u):
        for i in range(CHAIN_LAYERS):
            x = lins["o"][i](lins["qkv"][i](x)[:, :2048])
            x = lins["down"][i](pairs[i](x))
            x = lins["ple proj"][i](lins["ple gate"][i](x, gelu_times=u))
        return x

    def switch(on: bool) -> None:
        if setting == "prefetch":
            gluon_matmul.PREFETCH = on
        else:
            for lin in every:
                lin.reduce = on

    what, off_label, on_label, name = CHAIN_SETTINGS[setting]
    rows, saved = [], gluon_matmul.PREFETCH
    try:
        for m in (1, 16, 32):
            x = torch.randn(m, 2560, device="cuda", dtype=torch.bfloat16) * 0.1
            u = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
            graphs = {}
            for on in (False, True):
                switch(on)
                chain(x, u)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = chain(x, u)
                graphs[on] = (graph, y)
            outs = {}
            for on, (graph, y) in graphs.items():
                graph.replay()
                torch.cuda.synchronize()
                outs[on] = y.clone()
            ms = {False: [], True: []}
            for _ in range(rounds):
                for on, (graph, _) in graphs.items():
                    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    start.record()
                    for _ in range(10):
                        graph.replay()
                    end.record()
                    end.synchronize()
                    ms[on].append(start.elapsed_time(end) / 10)
            same = torch.equal(outs[False].nan_to_num(), outs[True].nan_to_num()) if setting == "prefetch" else None
            rows.append({"rows": m, "same_bits": same, **{f"{'on' if k else 'off'}_ms": v for k, v in ms.items()}})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        gluon_matmul.PREFETCH = saved
        for lin in every:
            lin.reduce = True
    med = lambda v: statistics.median(v)
    lines = [f"# E4B's int4 matmuls chained over 42 layers, {setting} ({torch.cuda.get_device_name()})", "",
             f"ms a chain of 42 x 6 dependent int4 matmuls (cold weights; median of the rounds, range). {what}.", "",
             f"| rows | {off_label} | {on_label} | {on_label} / {off_label} | same bits |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {med(r['off_ms']):.3f} ({min(r['off_ms']):.3f}-{max(r['off_ms']):.3f}) | "
                     f"{med(r['on_ms']):.3f} ({min(r['on_ms']):.3f}-{max(r['on_ms']):.3f}) | "
                     f"{med(r['on_ms']) / med(r['off_ms']):.3f}x | {'-' if r['same_bits'] is None else r['same_bits']} |")
    md = "\n".join(lines) + "\n"
    write_results(out, name, {"device": torch.cuda.get_device_name(), "setting": setting, "rows": rows}, md)
    print(md)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.small_m_bench")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--cold", action="store_true", help="configurations on cold weights (see the docstring)")
    p.add_argument("--epilogues", action="store_true", help="the gelu epilogues against a separate gelu kernel")
    p.add_argument("--chain", action="store_true", help="the weight prefetch off and on, a layer's matmuls chained")
    p.add_argument("--chain-tails", action="store_true",
                   help="the split-K sums left out and in, a layer's matmuls chained (what the sums cost)")
    args = p.parse_args(argv)
    if args.chain:
        return main_chain(args.out)
    if args.chain_tails:
        return main_chain(args.out, "tails")
    if args.cold:
        return main_cold(args.out)
    if args.epilogues:
        return main_epilogues(args.out)
    configs = [(64, 4, 4, 528, False), (32, 4, 3, 264, True), (64, 4, 4, 528, True), (128, 4, 4, 528, True)]
    rows = [measure(*s, dense=False, configs=configs) for s in SHAPES]
    rows.append(measure(*LM_HEAD, dense=True, configs=[(64, 4, 3, 264, False), (128, 4, 3, 264, False)]))
    rows.append(measure(*LM_HEAD_INT8, dense=True, int8=True,
                        configs=[(64, 4, 4, 528, False), (64, 4, 3, 264, False), (128, 4, 3, 264, False)]))
    attention = [row for a in ATTENTION for row in measure_attention(*a)]
    tot = {key: sum(r[key] * r["count"] for r in rows) / 1e3 for key in ("base_us_1", "base_us_16")}
    ours = {f"us_{m}": sum(r["best"][f"us_{m}"] * r["count"] for r in rows) / 1e3 for m in (1, 16)}
    results = {"device": torch.cuda.get_device_name(), "rows": rows, "attention": attention, "per_forward_ms": {"tinygemm/cuBLAS": tot, "small_m": ours}}
    lines = [f"# Small-M matmul vs tinygemm/cuBLAS, E4B shapes ({results['device']})", "",
             "| layer | N | K | x/forward | tinygemm 1 row us | 16 rows | ours 1 row us | 16 rows | ours config | rel err (tinygemm / ours) | row-invariant (tinygemm / ours) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["best"]
        lines.append(f"| {r['name']} | {r['n']} | {r['k']} | {r['count']} | {r['base_us_1']:.1f} | {r['base_us_16']:.1f} | "
                     f"{b['us_1']:.1f} | {b['us_16']:.1f} | n{b['block_n']} w{b['warps']} s{b['stages']} split {b['split']}{' magic' if b['magic'] else ''} | "
                     f"{r['base_rel_err']:.1e} / {b['rel_err']:.1e} | {r['base_invariant']} / {b['invariant']} |")
    lines += ["", "Ours: the fastest of the configurations tried for each shape (column tile n, warps w, pipeline "
              "stages s, K slices, magic-number int4 decoding); the fast path runs one fixed configuration "
              "(server/small_m_matmul.py), whose whole steps bench/gpu_e4b.py times."]
    lines += ["", f"Per forward (sum over layers): tinygemm/cuBLAS {tot['base_us_1']:.2f} ms (1 row), "
              f"{tot['base_us_16']:.2f} ms (16 rows); small-M {ours['us_1']:.2f} ms / {ours['us_16']:.2f} ms."]
    lines += ["", "| attention | context | T | torch bmm+softmax us | ours us | rel err vs fp32 (torch / ours) | row-invariant (torch / ours) |",
              "|---|---|---|---|---|---|---|"]
    for a in attention:
        lines.append(f"| {a['name']} | {a['context']} | {a['T']} | {a['torch_us']:.1f} | {a['ours_us']:.1f} | "
                     f"{a['torch_rel_err']:.1e} / {a['rel_err']:.1e} | {a['torch_invariant']} / {a['invariant']} |")
    md = "\n".join(lines) + "\n"
    write_results(args.out, "small_m", results, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
