"""The GPU step attention's kernels (server/gpu_kernels.py via server/step_attention.py), run by
Triton's interpreter on the CPU, against a plain reference: chains and token trees, full layers
and sliding rings that wrap, 1 to 64 rows.

Why: CI has no GPU, so the CUDA tests (tests/test_step_kernel_rows.py, tests/test_fast_tree.py)
skip there; this checks the kernels' index arithmetic (which chunks a step wrote, which key each
tree row reads at each depth, the window, the ring) on every CI run. The interpreter computes in
numpy, so the inputs are float32 (it does not emulate bfloat16): this proves what each row
attends to, and the CUDA tests prove the bits. The merge (each row's chunk partials combined in chunk
order) is done by a torch twin in most cases (the interpreter runs the merge kernel slowly); in
MERGE_CASES the merge kernel runs too, and must agree with the twin. The step's K/V rows handed to
the launch instead of written before it (new_kv) must give the same bits, with the launch's writes left out too (then no read can see a value it just wrote),
and leave the cache as index_copy_ would. With 3 query heads a KV head a token's rows straddle two
row blocks (ODD_GROUP_CASES): against the reference too. Runs in a subprocess: TRITON_INTERPRET must
be set before the kernels are defined.
"""
from __future__ import annotations

import random
import sys

import pytest

from tests.interpreted import interpreted_cases

# the last: a ring of 130 slots (its last chunk 2 slots) that a step starting at slot 126 wraps past and on
# into the chunk it began in
GEOMETRIES = ((False, 70, 256), (False, 127, 320), (True, 70, 96), (True, 200, 96), (True, 150, 200),
              (True, 126, 130))
# 64-row steps (chains and trees) in two geometries, a full layer and the ring that wraps: the
# interpreter's time grows with the rows, and 40-row trees cover a step past 16 rows everywhere
CASES = [(sliding, start, slots, T, tree)
         for sliding, start, slots in GEOMETRIES
         for T, tree in ((1, False), (5, False), (16, False), (64, False), (16, True), (40, True), (64, True))
         if T < 64 or (sliding, start, slots) in ((False, 70, 256), (True, 200, 96))]
# The cases also run with the step's K/V rows handed to the launch (new_kv): in every geometry a short
# chain, a 16-row tree and a 40-row tree; every size in the ring that wraps (the interpreter's time
# grows with the rows and the runs: CI time)
WRITE_CASES = [case for case in CASES if case[3] in (5, 40) or (case[3] == 16 and case[4])
               or (case[0] and case[1] == 200)]
# The merge kernel, in every geometry at 1 and 5 rows (5 rows of 4 heads: two
# row blocks, and own-chunk programs of several tokens a row block), and one 16-row tree on the ring
# that wraps (the interpreter runs the merges slowly: CI time)
MERGE_CASES = [case for case in CASES if case[3] <= 5] + [(True, 200, 96, 16, True)]
# With 3 query heads a KV head, where a token's rows can straddle two row blocks of 16: trees whose
# first 8 rows are a chain (as the drafter lays a tree out: its main chain first), so a row block of the
# chain's rows sits beside one with branches
ODD_GROUP, ODD_GROUP_CASES = 3, [(False, 70, 256, 16, "chain first"), (True, 150, 200, 40, "chain first")]


def test_step_attention_rows_attend_to_their_chains_keys(tmp_path):
    pytest.importorskip("triton")
    import torch

    outputs = interpreted_cases(__file__, tmp_path)
    assert len(outputs) == len(CASES) + len(ODD_GROUP_CASES)
    errors = {}
    for case, got in zip(ODD_GROUP_CASES, outputs[len(CASES):]):
        q, k, v, slot_pos, parents, qpos, path = case_inputs(*case, group=ODD_GROUP)
        errors[case, ODD_GROUP] = float((got.double() - reference(q, k, v, case[1], parents, slot_pos, WINDOW,
                                                                    SCALING)).abs().max())
    for case, (got, written, unwritten, cache_right, merged) in zip(CASES, outputs):
        if case in MERGE_CASES:
            # The merge kernel: the torch twin's output within float32 rounding.
            assert float((merged - got).abs().max()) < 1e-5, case
        else:
            assert merged is None
        # The step's K/V handed to the launch instead of written before it: the same bits, whether or
        # not its writes land (no program reads a slot the launch writes), and the launch leaves the
        # cache as the write would have (server/step_attention.py new_kv).
        if case in WRITE_CASES:
            assert torch.equal(written, got), (case, float((written - got).abs().max()))
            assert torch.equal(unwritten, got), (case, float((unwritten - got).abs().max()))
            assert cache_right, case
        else:
            assert written is None
        q, k, v, slot_pos, parents, qpos, path = case_inputs(*case)
        want = reference(q, k, v, case[1], parents, slot_pos, WINDOW, SCALING)
        errors[case] = float((got.double() - want).abs().max())
    bad = {case: err for case, err in errors.items() if not err < 1e-5}
    assert not bad, bad  # float32 sums in another order; a wrong key or mask gives ~0.1 or more


def reference(q, k, v, start, parents, slot_pos, window, scaling):
    """Float64 attention of each step row over the keys its chain would see: positions before the
    step from their slots, position start + j from the slot of the row's ancestor at depth j."""
    import torch

    T, H, D = q.shape
    group = H // k.shape[0]
    slots = k.shape[1]
    parent = [parents[t] if parents else t - 1 for t in range(T)]
    ring = slot_pos.tolist() if slot_pos is not None else None
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        path = [t]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        path.reverse()                          # path[j]: t's ancestor at depth j
        qpos = start + len(path) - 1
        cols = []
        for pos in range(qpos + 1):
            if ring is not None and pos <= qpos - window:
                continue
            row = path[pos - start] if pos >= start else None
            slot = pos if row is None else start + row
            if ring is not None:
                slot %= slots
                if row is None and ring[slot] != pos:
                    continue                    # that position's key was overwritten in the ring
            cols.append(slot)
        keys, values = k[:, cols], v[:, cols]                               # [kv_heads, n, D]
        heads = q[t].view(k.shape[0], group, D)                             # [kv_heads, group, D]
        weights = torch.softmax(heads @ keys.transpose(1, 2) * scaling, -1)
        out[t] = (weights @ values).reshape(H, D)
    return out.reshape(T, H * D)


def _torch_merge(grid):
    """_step_attention_combine's twin: each row's chunk partials merged in chunk order."""
    import torch

    def run(m, l, acc, qpos, out, stride_ot, n_rows, n_chunks, n_used, G, D, SLIDING, BLOCK_S, num_warps=4):
        for kvh in range(grid[0]):
            for r in range(grid[1]):
                t = r // G
                last = n_used - 1 if SLIDING else min(int(qpos[t]) // BLOCK_S, n_used - 1)
                base = (kvh * n_rows + r) * n_chunks
                ms = m[base:base + last + 1]
                w = torch.exp(ms - ms.max())
                total = (w[:, None] * acc.view(-1, D)[base:base + last + 1]).sum(0)
                head = kvh * G + r % G
                out[t, head * D:(head + 1) * D] = (total / (w * l[base:base + last + 1]).sum()).to(out.dtype)
    return run


class _Merge:
    def __getitem__(self, grid):
        return _torch_merge(grid)


def merged_by_the_kernel(run, combine):
    """Under the interpreter, with the torch twin as the merge around it: `run()`'s output with the
    merge kernel `combine` instead."""
    import server.gpu_kernels as kernels

    kernels._step_attention_combine = combine
    try:
        return run()
    finally:
        kernels._step_attention_combine = _Merge()


KV_HEADS, GROUP, HEAD_DIM, WINDOW = 2, 4, 64, 40
SCALING = HEAD_DIM ** -0.5


def case_inputs(sliding, start, slots, T, tree, group=GROUP):
    """The same random inputs in both processes: q, k, v, the ring's positions (after the step
    wrote positions start..start+T-1), parents (None: a chain), each row's position, its paths."""
    import torch

    from server.fast_path import tree_paths, tree_rows

    g = torch.Generator().manual_seed(start * 100 + T)
    k = torch.randn(KV_HEADS, slots, HEAD_DIM, generator=g)
    v = torch.randn(KV_HEADS, slots, HEAD_DIM, generator=g)
    q = torch.randn(T, KV_HEADS * group, HEAD_DIM, generator=g)
    slot_pos = None
    if sliding:
        slot_pos = torch.full((slots,), -1, dtype=torch.long)
        for p in range(max(0, start + T - slots), start + T):
            slot_pos[p % slots] = p
    rng = random.Random(T + slots)
    parents = [-1] + [rng.randrange(max(0, j - 3), j) for j in range(1, T)] if tree else None
    if tree == "chain first":
        parents[:8] = range(-1, 7)
    if tree:
        depth, _ = tree_rows(parents, T, T)
        return q, k, v, slot_pos, parents, torch.from_numpy(depth) + start, torch.from_numpy(tree_paths(parents, T, T))
    return q, k, v, slot_pos, None, torch.arange(start, start + T), None


def main(out: str, shard: str = "0", shards: str = "1") -> int:
    """Under the interpreter: the step attention output of every shards-th case from `shard` on,
    saved to `out` as (case index, output) pairs."""
    import torch

    import server.gpu_kernels as kernels
    from tests.interpreted import interpreter_takes_numpy_2_scalars

    interpreter_takes_numpy_2_scalars()   # the merge kernel loops to its n_used argument
    from server import step_attention

    class StepAttention(step_attention.StepAttention):
        """Its scratch NaN before every call: a partial a call leaves unwritten and its merge reads
        shows, rather than one an earlier call left there."""

        def __call__(self, *args, **kwargs):
            for scratch in (self.m, self.l, self.acc):
                scratch.fill_(float("nan"))
            return super().__call__(*args, **kwargs)

    combine = kernels._step_attention_combine
    kernels._step_attention_combine = _Merge()
    outputs = []
    for i, (sliding, start, slots, T, tree) in enumerate(CASES):
        if i % int(shards) != int(shard):
            continue
        q, k, v, slot_pos, _, qpos, path = case_inputs(sliding, start, slots, T, tree)
        attn = StepAttention(KV_HEADS, GROUP, HEAD_DIM, slots, 64, "cpu")
        kv_len = slots if sliding else start + T
        got = attn(q, k, v, kv_len, qpos, slot_pos, WINDOW, SCALING, path)
        merged = None
        if (sliding, start, slots, T, tree) in MERGE_CASES:
            merged = merged_by_the_kernel(lambda: attn(q, k, v, kv_len, qpos, slot_pos, WINDOW, SCALING, path),
                                          combine)
        if (sliding, start, slots, T, tree) not in WRITE_CASES:
            outputs.append((i, (got, None, None, None, merged)))
            continue
        # The same step with its rows not yet in the cache (those slots hold other numbers), handed
        # to the launch, which writes them: row t at slot start + t.
        where = torch.arange(start, start + T) % (slots if sliding else 1 << 30)
        new_k, new_v = k[:, where].transpose(0, 1).contiguous(), v[:, where].transpose(0, 1).contiguous()
        stale_k, stale_v = k.clone(), v.clone()
        stale_k[:, where] += 100.0
        stale_v[:, where] -= 100.0
        # The interpreter runs the programs one after another, so a read of a written slot could see
        # the value just written: first with the writes left out (the slots stay stale), where such
        # a read gives other numbers, then as shipped, which must leave the cache as index_copy_ would.
        write_row = kernels._write_own_row
        kernels._write_own_row = lambda *args: None
        unwritten = attn(q, stale_k.clone(), stale_v.clone(), kv_len, qpos, slot_pos, WINDOW, SCALING, path,
                         new_kv=(new_k, new_v))
        kernels._write_own_row = write_row
        written = attn(q, stale_k, stale_v, kv_len, qpos, slot_pos, WINDOW, SCALING, path, new_kv=(new_k, new_v))
        outputs.append((i, (got, written, unwritten, torch.equal(stale_k, k) and torch.equal(stale_v, v), merged)))
    for i, case in enumerate(ODD_GROUP_CASES, len(CASES)):
        if i % int(shards) != int(shard):
            continue
        sliding, start, slots, T, tree = case
        q, k, v, slot_pos, _, qpos, path = case_inputs(*case, group=ODD_GROUP)
        attn = StepAttention(KV_HEADS, ODD_GROUP, HEAD_DIM, slots, 64, "cpu")
        kv_len = slots if sliding else start + T
        outputs.append((i, attn(q, k, v, kv_len, qpos, slot_pos, WINDOW, SCALING, path)))
    torch.save(outputs, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
