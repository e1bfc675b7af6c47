"""The fast path's compiled elementwise ops (server/fast_ops.py compile_ops) keep one compiled
kernel per op for steps of every size. Two compilations of an op are two kernels whose sums may
round differently, so a row would get other bits in a step of another size and drafted output
would leave plain output: on the H200 (E4B shape) duck sizing took a 2-row step's row count for
the symbol of the 2 KV heads, and plain decoding's bucket-2 steps ran a kernel of their own.
Counted here on the CPU with a backend that records each compilation (dynamo's guards and
recompilations are the same whichever backend compiles)."""
from __future__ import annotations

import torch

from server.fast_ops import compile_ops
from server.fast_path import FastTarget
from tests.test_engine_lossless import tiny_gemma4


def test_steps_of_every_bucket_share_one_compilation_per_op():
    # 8 query heads and 2 KV heads: the sizes of steps of 2 and 8 rows, as on E4B
    model = tiny_gemma4(seed=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16, global_head_dim=32)
    fast = FastTarget(model, max_len=256, buckets=(2, 4, 8, 16), prefill_chunk=32, capture=False, fuse=False)
    compilations: list[str] = []

    def counting(gm, example_inputs):
        compilations.append(str(gm.code))
        return gm.forward

    fast.ops = compile_ops(backend=counting)
    torch._dynamo.reset()
    try:
        fast.prefill(list(range(3, 43)))
        fast.step([5])  # a plain step: bucket 2
        first = len(compilations)
        assert first > 0
        for n in (3, 8, 16, 1, 5, 12, 2):  # buckets 4, 8, 16, 2, 8, 16, 2
            fast.step(list(range(7, 7 + n)))
        assert len(compilations) == first, (
            f"{len(compilations) - first} more compilations for steps of other sizes than the first step's")
    finally:
        torch._dynamo.reset()  # the counting compilations leave no cache entries to later tests
