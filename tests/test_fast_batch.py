"""Lanes of the GPU fast path (server/fast_batch.py): several requests' steps in one forward.

On the CPU (fp32, no step kernels, uncaptured) a stacked forward rounds its matmuls differently from
a lone one, so these check closeness of the logits and equality of the tokens; on CUDA with the step
kernels the logits are equal bit for bit (the CUDA tests). Chains and trees, prompts past the sliding
window, rejected drafts, the engine with --parallel, and a prefix cache shared by the lanes.
"""
from __future__ import annotations

import threading

import pytest
import torch

from server.fast_batch import FastBatch, LaneStep, fast_lanes, stacked_groups, summed_groups
from server.fast_path import FastTarget
from server.sampling import row_argmax, row_of, with_argmax
from tests.test_engine_lossless import engine_for, prompts_for, run, tiny_gemma4

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma4(seed=5)


def cpu_target(model, **kw) -> FastTarget:
    return FastTarget(model, max_len=256, prefill_chunk=16, capture=False, min_kv_len=16, **kw)


def steps_of(vocab: int, seed: int) -> list[tuple[list[int], list[int] | None]]:
    """Three steps of one lane: a chain of 1, a tree of 5 (two branches), a chain of 7."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()
    return [(ids(1), None), (ids(5), [-1, 0, 1, 0, 3]), (ids(7), None)]


@pytest.mark.parametrize("int8_head", [False, True])
def test_batched_steps_match_each_lane_alone_cpu(tiny, int8_head):
    """With the int8 head (a model whose hidden size tiles it), every lane stages its own
    embedding rows from the host table."""
    model = tiny_gemma4(seed=5, hidden_size=128, intermediate_size=256) if int8_head else tiny
    vocab = model.config.vocab_size
    prompts = prompts_for(vocab, (5, 20, 45), seed=1)  # the window is 8: two prompts run past it
    lanes = fast_lanes(cpu_target(model, lm_head_int8=int8_head), 3)
    assert all(lane.embed_on_host == int8_head for lane in lanes)
    alone = [cpu_target(model, lm_head_int8=int8_head) for _ in prompts]
    for lane, solo, prompt in zip(lanes, alone, prompts):
        a, b = lane.start(prompt, reuse=False).logits, solo.start(prompt, reuse=False).logits
        assert torch.equal(a, b)
    batch = lanes[0].batch
    assert isinstance(batch, FastBatch) and all(lane.batch is batch for lane in lanes)
    plans = [steps_of(vocab, seed) for seed in range(3)]
    for k in range(3):
        got = batch.forward_batch([LaneStep(lane, *plan[k]) for lane, plan in zip(lanes, plans)])
        for i, (solo, plan) in enumerate(zip(alone, plans)):
            want = solo.step(*plan[k])
            assert got[i].shape == want.shape
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
            assert torch.equal(got[i].argmax(-1), want.argmax(-1)), (k, i)
            if plan[k][1] is not None:  # a tree: keep one root path, as a verify would
                lanes[i].keep_path([0, 1, 2])
                solo.keep_path([0, 1, 2])
            assert lanes[i].position == solo.position
        lanes[1].rollback(1)  # a rejected draft token in one lane only
        alone[1].rollback(1)


def greedy(backend, prompt: list[int], n: int, draft_every: int = 3) -> list[int]:
    """Greedy tokens with 2-token guesses every few steps (wrong ones rolled back), through
    start / step / rollback / finish as the engine calls them."""
    out = [int(backend.start(prompt, reuse=True).logits.argmax())]
    while len(out) < n:
        guess = [out[-1], (out[-1] * 7 + 3) % 500 + 3, out[-1]] if len(out) % draft_every == 0 else [out[-1]]
        logits = backend.step(guess)
        target = logits.argmax(-1).tolist()
        k = 0
        while k < len(guess) - 1 and guess[k + 1] == target[k]:
            k += 1
        backend.rollback(len(guess) - 1 - k)
        out += guess[1:k + 1] + [target[k]]
    out = out[:n]
    backend.rollback(backend.position - len(prompt) - len(out) + 1)
    backend.finish(list(prompt) + out[:-1], len(out) - 1)
    return out


@pytest.mark.parametrize("prefill_by_steps", [0, 32])  # 32: prompts of up to 32 tokens are written by steps
def test_lanes_in_threads_give_each_request_its_solo_tokens_cpu(tiny, prefill_by_steps):
    vocab = tiny.config.vocab_size
    prompts = prompts_for(vocab, (4, 9, 17, 30, 12, 25), seed=2)
    solo = cpu_target(tiny)
    want = [greedy(solo, p, 24) for p in prompts]
    lanes = fast_lanes(cpu_target(tiny, prefill_by_steps=prefill_by_steps), 4)
    assert all(lane.prefill_by_steps == prefill_by_steps for lane in lanes)
    got: dict[int, list[int]] = {}
    free = list(lanes)
    lock = threading.Lock()

    def worker(i: int, prompt: list[int]) -> None:
        with lock:
            lane = free.pop()
        try:
            got[i] = greedy(lane, prompt, 24)
        finally:
            with lock:
                free.append(lane)

    threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(prompts[:4])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts[4:], start=4):  # then more, on lanes that served one already
        worker(i, p)
    assert [got[i] for i in range(len(prompts))] == want
    summary = lanes[0].batcher.summary()
    assert summary["forwards"] > 0 and summary["peak_sequences"] >= 2, summary
    assert summary["members"] == 0  # every request left the rendezvous


def test_engine_parallel_on_the_fast_path_equals_solo_cpu(tiny):
    vocab = tiny.config.vocab_size
    prompts = prompts_for(vocab, (6, 15, 28, 40), seed=3)
    solo = engine_for(tiny, backend=cpu_target(tiny))
    want = [run(solo, p, max_tokens=20, draft=False)[0] for p in prompts]
    engine = engine_for(tiny, backend=cpu_target(tiny), parallel=4)
    assert engine.parallel == 4 and any("parallel: 4" in n for n in engine.notes)
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i, p=p: got.__setitem__(i, run(engine, p, max_tokens=20, draft=False)[0]))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(prompts))] == want
    assert engine.batch_summary()["forwards"] > 0


def test_lanes_share_the_prefix_cache_cpu(tiny):
    """A conversation kept by one lane is resumed by another: the store is shared."""
    vocab = tiny.config.vocab_size
    first = cpu_target(tiny, prefix_budget_bytes=1 << 24)
    lanes = fast_lanes(first, 2)
    assert lanes[1].store is lanes[0].store
    prompt = prompts_for(vocab, (30,), seed=4)[0]
    reply = greedy(lanes[0], prompt, 10)
    assert lanes[0].held_prefix(prompt + reply[:-1]) == len(prompt) + len(reply) - 1  # live in lane 0
    assert lanes[0].held_prefix(prompt[:10] + [1, 2]) == 0  # leaves it inside its prompt: not counted
    lanes[0].start(prompts_for(vocab, (12,), seed=5)[0], reuse=True)  # lane 0 moves on: its sequence is kept
    lanes[0].discard()
    assert len(lanes[0].store) == 1 and lanes[0].held_prefix(prompt) == 0
    follow = prompt + reply[:-1] + [7, 8, 9]
    reused = lanes[1].start(follow, reuse=True).reused
    assert reused >= len(prompt)  # resumed from the kept sequence, not prefilled from 0
    ref = cpu_target(tiny)
    torch.testing.assert_close(lanes[1].step([5]), (ref.start(follow, reuse=False), ref.step([5]))[1],
                               rtol=1e-4, atol=1e-4)


def test_the_engine_gives_a_conversation_the_lane_that_holds_it_cpu(tiny):
    """The next turn of a conversation goes to the lane whose cache holds the last one (resumed in
    place, nothing copied or kept twice), whichever lane served it."""
    vocab = tiny.config.vocab_size
    engine = engine_for(tiny, backend=cpu_target(tiny, prefix_budget_bytes=1 << 24), parallel=3)
    first = prompts_for(vocab, (20,), seed=7)[0]
    other = prompts_for(vocab, (15,), seed=8)[0]
    reply, *_, stats = run(engine, first, max_tokens=8, draft=False)
    run(engine, other, max_tokens=4, draft=False)  # another conversation in between, on another lane
    follow = first + reply + [11, 12]
    *_, stats = run(engine, follow, max_tokens=4, draft=False)
    assert stats.cached_tokens >= len(first) + len(reply) - 1, stats
    assert len(engine.backend.store) == 0  # resumed in place: no copy was kept


def test_a_step_that_cannot_run_is_refused_before_it_joins_a_forward(tiny):
    lanes = fast_lanes(cpu_target(tiny), 2)
    lanes[0].start([2, 5, 6], reuse=False)
    with pytest.raises(ValueError, match="bucket"):
        lanes[0].step(list(range(3, 3 + lanes[0].max_bucket + 1)))
    assert lanes[0].batcher.summary()["forwards"] == 0
    lanes[0].discard()
    assert lanes[0].batcher.summary()["members"] == 0


def test_a_prompt_that_fails_mid_steps_leaves_the_rendezvous(tiny, monkeypatch):
    """A lane joins the lanes' forwards for its prompt steps; if one raises, start() takes it out
    again, so the other lanes' forwards stop waiting for it."""
    lanes = fast_lanes(cpu_target(tiny, prefill_by_steps=32), 2)

    def broken(ids, parents=None):
        assert lanes[0].batcher.members == 1  # joined before its prompt steps
        raise RuntimeError("a forward failed")

    monkeypatch.setattr(lanes[0], "step", broken)
    with pytest.raises(RuntimeError, match="a forward failed"):
        lanes[0].start([2, 5, 6, 7, 8], reuse=False)
    assert lanes[0].batcher.members == 0 and lanes[0].shared_load() == (0, 0)


def test_shared_room_keeps_a_forward_within_the_rows_budget(tiny):
    """GPU lanes' drafts (FastTarget.shared_room, read by the engine): alone, the largest bucket's;
    beside k other lanes, each takes its share of `rows_for(k + 1)` rows (16 for two lanes, 32 for
    three or more), at least one drafted token."""
    lanes = fast_lanes(cpu_target(tiny, buckets=(2, 4, 8, 16)), 3)
    lane, batch = lanes[0], lanes[0].batch
    assert batch.rows_budget == lane.max_bucket == 16 and batch.rows_for(2) == 16
    assert batch.rows_for(3) == batch.rows_for(16) == 32
    assert lane.shared_room((0, 0)) == 15
    # each lane's step bucket within its share: 2 lanes 8 rows, 3 lanes 10 -> bucket 8, 4 lanes 8,
    # 8 lanes 4, 16 lanes 2 -> one drafted token
    assert lane.shared_room((1, 4)) == 7 and lane.shared_room((2, 8)) == 7 and lane.shared_room((3, 9)) == 7
    assert lane.shared_room((7, 20)) == 3 and lane.shared_room((15, 30)) == 1
    assert lane.shared_load() == (0, 0)  # not in a request: nobody shares its forwards
    for _ in range(4):  # lanes in a request now count, whoever shared the last forward
        lane.batch.join()
    assert lane.shared_room((0, 0)) == 7
    for _ in range(4):
        lane.batch.leave()
    from server.engine import shared_room
    assert shared_room(lane) == 15 and shared_room(object()) > 1000  # a backend without lanes: no bound


def test_stacked_groups_fit_the_most_steps_in_the_fewest_forwards():
    """A prompt's 16-token step beside 15 lanes' 2-token steps: 2 forwards (15 x 2 rows, and the
    16 alone), not 4 of 4 lanes padded to 16 rows each as arrival order gave."""
    widths = [16] + [2] * 15
    groups = stacked_groups(widths, 64)
    assert sorted(len(g) for g in groups) == [1, 15] and [0] in groups
    assert stacked_groups([4] * 4, 64) == [[0, 1, 2, 3]]
    assert sorted(len(g) for g in stacked_groups([16] * 5, 64)) == [1, 4]
    assert sorted(stacked_groups([64, 2], 64)) == [[0], [1]]
    assert stacked_groups([], 64) == []


def test_stacked_groups_are_a_partition_within_the_rows_and_as_few_as_any():
    """Every step once; each forward's steps times its widest at most the rows; and no partition of
    the steps into stacked forwards has fewer (brute force over small cases)."""
    import itertools
    import random

    def fewest(widths, cap):  # the smallest number of groups of any set partition that fits
        n = len(widths)
        for k in range(1, n + 1):
            for labels in itertools.product(range(k), repeat=n):
                if len(set(labels)) != k:
                    continue
                if all(sum(1 for x in labels if x == g) * max(w for w, x in zip(widths, labels) if x == g) <= cap
                       for g in range(k)):
                    return k
        return 0

    rng = random.Random(3)
    for _ in range(150):
        widths = [rng.choice([2, 4, 8, 16, 32]) for _ in range(rng.randint(1, 6))]
        groups = stacked_groups(widths, 32)
        assert sorted(i for g in groups for i in g) == list(range(len(widths)))
        assert all(len(g) * max(widths[i] for i in g) <= 32 for g in groups)
        assert len(groups) == fewest(widths, 32), widths
    assert summed_groups([8, 8, 40, 8], 48) == [[0, 1], [2, 3]]


def test_argmax_a_forward_attaches_is_what_row_argmax_returns():
    """with_argmax (a shared forward's argmax of all its rows, read back once: server/batch_step.py)
    is what row_argmax then returns for those logits; a count that does not match is refused, and
    a slice or copy computes its own."""
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, -1.0, 5.0]])
    assert row_argmax(logits) == [1, 0]
    tagged = with_argmax(logits.clone(), [1, 0])
    assert row_argmax(tagged) == [1, 0]
    assert row_argmax(with_argmax(logits.clone(), [2, 2])) == [2, 2]  # the attached values, not recomputed
    assert row_argmax(tagged[1:]) == [0] and row_argmax(tagged.clone()) == [1, 0]
    with pytest.raises(ValueError, match="3 argmax values for 2 rows"):
        with_argmax(logits, [0, 1, 2])
    # a plain step's row (the engine's row_of) keeps its value; untagged logits give a plain row
    assert row_argmax(row_of(with_argmax(logits.clone(), [2, 2]), 1)) == [2]
    assert row_argmax(row_of(logits, 1)) == [0] and torch.equal(row_of(logits, 1), logits[1])


# ---------------------------------------------------------------- CUDA


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("lanes_n", [2, 8])
@pytest.mark.parametrize("wide_min_columns", [None, 0])
def test_batched_steps_equal_each_lane_alone_cuda(lanes_n, capture, wide_min_columns, monkeypatch):
    """On the step kernels a lane's logits in a shared forward (stacked: server/batch_step.py,
    every step padded to the widest one's bucket, one kv_len, captured or not) are its lone
    step's, bit for bit: chains and trees of different sizes in one forward, lanes at different
    kv_len buckets, 2 and 8 lanes (at most 64 rows a forward: 8 lanes of 16 rows take two). With
    the shipped column threshold of the wide tiling (None: the tiny model's linears keep their own
    tiling) and with every linear of two row tiles or more on it (0)."""
    from server import small_m_matmul
    from tests.test_fast_path import cuda_model

    if wide_min_columns is not None:
        monkeypatch.setattr(small_m_matmul, "WIDE_MIN_COLUMNS", wide_min_columns)

    model = cuda_model(torch.bfloat16, quant=True)
    _lanes_equal_alone(model, lanes_n, capture, [7 + 23 * i for i in range(lanes_n)], max_len=512, rounds=2)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_engine_parallel_on_the_gpu_fast_path_equals_solo_cuda():
    """--parallel 4 on the GPU fast path (lanes, stacked captured forwards, prompt steps shared):
    6 requests, 4 at a time, drafted by prompt lookup, greedy and seeded-sampled, each its solo output."""
    from tests.test_engine_lossless import PromptLookup
    from tests.test_fast_path import cuda_model

    model = cuda_model(torch.bfloat16, quant=True)
    make = lambda: FastTarget(model, max_len=512, prefill_chunk=64, min_kv_len=64, buckets=(2, 4, 8, 16),
                              prefill_by_steps=32)
    prompts = prompts_for(model.config.vocab_size, (9, 30, 70, 120, 25, 200), seed=4)
    sampling = [dict(temperature=0.0), dict(temperature=0.8, seed=11)] * 3
    solo = engine_for(model, drafter=PromptLookup(), backend=make())
    want = [run(solo, p, max_tokens=40, **s)[0] for p, s in zip(prompts, sampling)]
    engine = engine_for(model, drafter=PromptLookup(), backend=make(), parallel=4)
    assert engine.parallel == 4
    got: dict[int, list[int]] = {}
    todo = list(range(len(prompts)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            got[i] = run(engine, prompts[i], max_tokens=40, **sampling[i])[0]

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(prompts))] == want
    summary = engine.batch_summary()
    assert summary["peak_sequences"] >= 2 and summary["members"] == 0, summary


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_batched_steps_equal_each_lane_alone_past_a_wrapped_ring_cuda():
    """The same on E4B's proportions where the tiny model differs: 4 query heads per KV head, a
    512-wide full-attention head (64-slot chunks, 8 warps), a sliding ring of three chunks that
    every prompt has wrapped, the per-layer table on the host, and the int8 LM head with the
    embedding table on the host (each lane's rows staged for the stacked forward). (On the E4B shape, streams first
    left their solo tokens past the ring's size: bench/results/gpu_concurrency.md.)"""
    from tests.test_fast_path import cuda_model

    model = cuda_model(torch.bfloat16, quant=True, sliding_window=200, num_attention_heads=8, global_head_dim=512)
    _lanes_equal_alone(model, 4, True, [300, 333, 410, 517], max_len=1024, rounds=6, ple_on_host=True,
                       lm_head_int8=True)


def _lanes_equal_alone(model, lanes_n: int, capture: bool, prompt_lens: list[int], max_len: int, rounds: int,
                       ple_on_host: bool = False, lm_head_int8: bool = False) -> None:
    """Lanes' steps in shared forwards against the same steps of lone FastTargets, logits bit for bit."""
    vocab = model.config.vocab_size
    make = lambda: FastTarget(model, max_len=max_len, prefill_chunk=64, min_kv_len=64, buckets=(2, 4, 8, 16),
                              capture=capture, ple_on_host=ple_on_host, lm_head_int8=lm_head_int8)
    lanes = fast_lanes(make(), lanes_n)
    assert lanes[0].batch.stacked is not None
    alone = [make() for _ in range(lanes_n)]
    prompts = prompts_for(vocab, prompt_lens, seed=6)
    for lane, solo, prompt in zip(lanes, alone, prompts):
        assert torch.equal(lane.start(prompt, reuse=False).logits, solo.start(prompt, reuse=False).logits)
    plans = [steps_of(vocab, seed) for seed in range(lanes_n)]
    for k in range(3 * rounds):
        mine = [plan[(k + i) % 3] for i, plan in enumerate(plans)]  # a forward mixes 1, 5 and 7 tokens
        got = lanes[0].batch.forward_batch([LaneStep(lane, *step) for lane, step in zip(lanes, mine)])
        for i, (solo, step) in enumerate(zip(alone, mine)):
            want = solo.step(*step)
            assert torch.equal(got[i], want), (k, i)
            assert row_argmax(got[i]) == want.argmax(-1).tolist(), (k, i)  # the shared forward's, read back once
            if step[1] is not None:
                lanes[i].keep_path([0, 1, 2])
                solo.keep_path([0, 1, 2])
    stacked = lanes[0].batch.stacked.summary()
    assert stacked["stacked_forwards"] >= 3 * rounds and (stacked["replays"] == stacked["stacked_forwards"]) == capture
