"""The stacked steps' kernels (server/batch_step.py: several lanes' steps in one launch per op),
run by Triton's interpreter on the CPU against the lone step's kernels and plain copies.

- `StepAttention.segments`: each segment's rows, over its own cache, ring and tree paths found
  through a table of addresses, equal what the lone kernel gives that step alone, exactly (the
  same programs; the merge is the torch twin of tests/test_step_attention_interpreted.py), with
  chains and trees, different start positions and a shared kv_len larger than a segment's own. The
  merge kernel itself agrees with the twin on the stacked rows.
- With the steps' K/V rows handed to the launch (not yet in the caches), the same rows, and the
  caches written as index_copy_ would; the ring-position kernel puts each position where
  index_copy_ would.

CI has no GPU; tests/test_fast_batch.py checks the bits of the whole stacked forward on CUDA.
Runs in a subprocess: TRITON_INTERPRET must be set before the kernels are defined.
"""
from __future__ import annotations

import sys

import pytest

# (sliding, cache slots, T, [(start, tree) per segment])
CASES = [(False, 320, 16, [(70, False), (127, True), (200, False)]),
         (True, 96, 16, [(70, False), (200, True), (150, False)]),
         (True, 96, 4, [(10, True), (95, False), (33, False), (64, True)]),
         # a ring of three chunks, steps that wrap past its end and start in its middle chunk
         (True, 300, 16, [(290, False), (500, True), (128, False), (899, True)])]
# where the merge kernel runs too (the interpreter runs them slowly): a full layer
# and a ring, each with several segments
MERGE_CASES = (0, 2)


def test_stacked_attention_and_writes_match_each_step_alone(tmp_path):
    pytest.importorskip("triton")
    import torch

    from tests.interpreted import interpreted_cases

    results = interpreted_cases(__file__, tmp_path)
    assert len(results) == len(CASES)
    for c, (case, (stacked, alone, writes_ok, merged)) in enumerate(zip(CASES, results)):
        assert len(stacked) == len(case[3]) + 1
        for s, (a, b) in enumerate(zip(stacked, alone)):
            assert torch.equal(a, b), (case, s, float((a - b).abs().max()))
        assert writes_ok, case
        assert (merged is not None) == (c in MERGE_CASES)
        if merged is not None:
            assert float((merged - torch.cat(stacked)).abs().max()) < 1e-5, case   # the kernel against the twin


def segment_inputs(sliding, slots, T, start, tree, seed):
    """One segment's step: q, k, v, ring positions, row positions and paths (padded to 64 x 64)."""
    import random

    import torch

    from server.fast_path import tree_paths, tree_rows
    from server.step_attention import chain_paths

    g = torch.Generator().manual_seed(seed)
    kv_heads, group, d = 2, 4, 64
    k = torch.randn(kv_heads, slots, d, generator=g)
    v = torch.randn(kv_heads, slots, d, generator=g)
    q = torch.randn(T, kv_heads * group, d, generator=g)
    slot_pos = torch.full((slots,), -1, dtype=torch.long)
    if sliding:
        for p in range(max(0, start + T - slots), start + T):
            slot_pos[p % slots] = p
    path = chain_paths(64)
    if tree:
        rng = random.Random(seed)
        parents = [-1] + [rng.randrange(max(0, j - 3), j) for j in range(1, T)]
        depth, _ = tree_rows(parents, T, T)
        path[:T, :T] = torch.from_numpy(tree_paths(parents, T, T))
        qpos = torch.from_numpy(depth) + start
    else:
        qpos = torch.arange(start, start + T)
    return q, k, v, slot_pos, qpos, path


def main(out: str, shard: str = "0", shards: str = "1") -> int:
    """Under the interpreter, every shards-th case from `shard` on, saved to `out` as (case index,
    result): per case (stacked rows per segment, each step alone, writes right)."""
    import torch

    import server.gpu_kernels as kernels
    from tests.interpreted import interpreter_takes_numpy_2_scalars

    interpreter_takes_numpy_2_scalars()   # the merge loops to its n_used argument
    from server.batch_step import padded_rows
    from server.step_attention import StepAttention
    from tests.test_step_attention_interpreted import _Merge, merged_by_the_kernel

    combine = kernels._step_attention_combine
    kernels._step_attention_combine = _Merge()
    window, scaling = 40, 64 ** -0.5
    results = []
    mine = lambda i: i % int(shards) == int(shard)
    for c, (sliding, slots, T, segs) in enumerate(CASES):
        if not mine(c):
            continue
        inputs = [segment_inputs(sliding, slots, T, start, tree, 7 * i + start)
                  for i, (start, tree) in enumerate(segs)]
        kv_len = max(start + T for start, _ in segs)
        alone = []
        for (start, _), (q, k, v, slot_pos, qpos, path) in zip(segs, inputs):
            attn = StepAttention(2, 4, 64, slots, 64, "cpu")
            alone.append(attn(q, k, v, start + T, qpos, slot_pos if sliding else None, window, scaling, path))
        table = torch.tensor([[k.data_ptr(), v.data_ptr(), sp.data_ptr(), path.data_ptr()]
                              for q, k, v, sp, qpos, path in inputs], dtype=torch.int64)
        R = len(segs) * T
        pad = padded_rows(R) - R  # the stacked forward's rows past the segments' (server/batch_step.py)
        q = torch.cat([i[0] for i in inputs] + [torch.randn(pad, 8, 64)])
        qpos = torch.cat([i[4] for i in inputs] + [torch.zeros(pad, dtype=torch.long)])
        k0 = inputs[0][1]
        attn = StepAttention(2, 4, 64, slots, 64, "cpu")
        got = attn.segments(q, table, 0, 1, len(segs), T, kv_len, qpos, sliding, slots, k0.stride(0), k0.stride(1),
                            inputs[0][5].stride(0), table.stride(0), 2, 3, window, scaling)
        stacked = [got[s * T:(s + 1) * T] for s in range(len(segs))]
        stacked.append(got[R:])  # no segment's: zeros
        # the merge kernel itself
        again = lambda: attn.segments(q, table, 0, 1, len(segs), T, kv_len, qpos, sliding, slots, k0.stride(0),
                                      k0.stride(1), inputs[0][5].stride(0), table.stride(0), 2, 3, window, scaling)
        merged = merged_by_the_kernel(again, combine) if c in MERGE_CASES else None
        alone.append(torch.zeros(pad, got.shape[1]))
        # The same forward with the steps' K/V rows not yet in the caches (those slots hold other
        # numbers), handed to the launch, which writes them (server/step_attention.py new_kv).
        where = torch.cat([torch.arange(start, start + T) for start, _ in segs]) % (slots if sliding else 1 << 30)
        new_k = torch.cat([k[:, where[s * T:(s + 1) * T]].transpose(0, 1) for s, (_, k, *_) in enumerate(inputs)])
        new_v = torch.cat([v[:, where[s * T:(s + 1) * T]].transpose(0, 1) for s, (_, _, v, *_) in enumerate(inputs)])
        new_k = torch.cat([new_k, torch.randn(pad, 2, 64)])  # the rows of no segment: written nowhere
        new_v = torch.cat([new_v, torch.randn(pad, 2, 64)])
        stale = [(k.clone(), v.clone()) for _, k, v, *_ in inputs]
        for s, (k, v) in enumerate(stale):
            k[:, where[s * T:(s + 1) * T]] += 100.0
            v[:, where[s * T:(s + 1) * T]] -= 100.0
        stale_table = table.clone()
        stale_table[:, 0] = torch.tensor([k.data_ptr() for k, _ in stale])
        stale_table[:, 1] = torch.tensor([v.data_ptr() for _, v in stale])
        run = lambda t: attn.segments(q, t, 0, 1, len(segs), T, kv_len, qpos, sliding, slots, k0.stride(0),
                                      k0.stride(1), inputs[0][5].stride(0), table.stride(0), 2, 3, window, scaling,
                                      new_kv=(new_k, new_v))
        # First with the writes left out (the interpreter runs programs in turn: a read of a written
        # slot could otherwise see the value just written), on copies that stay stale.
        copies = [(k.clone(), v.clone()) for k, v in stale]
        copy_table = table.clone()
        copy_table[:, 0] = torch.tensor([k.data_ptr() for k, _ in copies])
        copy_table[:, 1] = torch.tensor([v.data_ptr() for _, v in copies])
        write_row = kernels._write_own_row
        kernels._write_own_row = lambda *args: None
        unwritten = run(copy_table)
        kernels._write_own_row = write_row
        written = run(stale_table)
        caches_right = all(torch.equal(a, b) for (k, v), (_, k0_, v0_, *_) in zip(stale, inputs)
                           for a, b in ((k, k0_), (v, v0_)))
        results.append((c, (stacked, alone, torch.equal(written, got) and torch.equal(unwritten, got)
                            and caches_right and slot_positions_right(inputs, table, slots, T, segs), merged)))
    torch.save(results, out)
    return 0


def slot_positions_right(inputs, table, slots, T, segs) -> bool:
    """The ring-position kernel against index_copy_ on copies of the ring positions."""
    import torch

    from server.gpu_kernels import _write_slot_pos_segments

    S = len(segs)
    wpos = torch.cat([torch.arange(start, start + T) for start, _ in segs])
    ring = wpos % slots
    want = []
    for s, (q, k, v, slot_pos, qpos, path) in enumerate(inputs):
        wsp = slot_pos.clone()
        wsp.index_copy_(0, ring[s * T:(s + 1) * T], wpos[s * T:(s + 1) * T])
        want.append(wsp)
    _write_slot_pos_segments[(S * T,)](table, wpos, ring, T, table.stride(0), SLOT_POS_FIELD=2)
    return all(torch.equal(sp, w) for (q, k, v, sp, qpos, path), w in zip(inputs, want))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
