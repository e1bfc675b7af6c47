"""Token-tree verification on the fast path (server/fast_path.py): `step(ids, parents)` gives each
tree row the logits of the chain of its root path, and `keep_path` leaves the cache a chain step
of that path and a rollback would. On the GPU's step kernels both hold bit for bit; the CPU run
(fp32, masks instead of kernels, keys summed in another order) checks them to rounding."""
from __future__ import annotations

import random

import pytest
import torch

from server.fast_path import FastTarget, tree_paths, tree_rows
from tests.test_engine_lossless import TreeOracle, engine_for, first_divergence, run, tiny_gemma4
from tests.test_fast_path import cuda_model, needs_cuda, prompt_of


def random_tree(n: int, rng: random.Random, reach: int | None = None) -> list[int]:
    """parents of n rows: each row's parent one of the `reach` rows before it (None: any)."""
    return [-1] + [rng.randrange(0 if reach is None else max(0, j - reach), j) for j in range(1, n)]


def path_to(parents: list[int], j: int) -> list[int]:
    out = [j]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def leaves(parents: list[int]) -> list[int]:
    inner = set(parents[1:])
    return [j for j in range(len(parents)) if j not in inner]


def owned_kv(fast, start: int, k: int) -> dict:
    """The K/V of positions start..start+k-1 in every layer that owns a cache."""
    pos = torch.arange(start, start + k, device=fast.device)
    out = {}
    for i, kc in fast.k_cache.items():
        where = pos % fast.ring if fast.layers[i].sliding else pos
        out[i] = (kc[:, where].clone(), fast.v_cache[i][:, where].clone())
    return out


def check_trees(fast, vocab: int, same, trees: list[tuple[int, int | None]], seed: int = 0) -> None:
    rng = random.Random(seed)
    prompt = prompt_of(150, vocab, seed)
    for n, reach in trees:
        parents = random_tree(n, rng, reach)
        tokens = [rng.randrange(3, vocab) for _ in range(n)]
        fast.start(prompt, reuse=False)
        s = fast.position
        tree = fast.step(tokens, parents).float().clone()
        assert fast.position == s + n
        for leaf in leaves(parents):
            path = path_to(parents, leaf)
            fast.rollback(fast.position - s)
            same(tree[path], fast.step([tokens[j] for j in path]).float(), f"n={n} leaf {leaf}")

        # keep_path: the cache equals a chain step of the path (padded with other tokens to n rows,
        # the same bucket) and a rollback, and the next steps agree
        path = path_to(parents, max(leaves(parents), key=lambda j: len(path_to(parents, j))))
        k = len(path)
        fast.rollback(fast.position - s)
        fast.step(tokens, parents)
        fast.keep_path(path)
        assert fast.position == s + k
        assert list(fast.prefix.tokens[s:s + k]) == [tokens[j] for j in path]
        kv = owned_kv(fast, s, k)
        wrote = torch.arange(s, s + fast._bucket(n), device=fast.device)  # every slot the tree step wrote
        assert torch.equal(fast.slot_pos[wrote % fast.ring], wrote)       # holds its position, as a chain's
        more = [rng.randrange(3, vocab) for _ in range(5)]
        after = torch.cat([fast.step(more).float(), fast.step([more[0]]).float()])
        fast.rollback(fast.position - s)
        fast.step([tokens[j] for j in path] + tokens[:n - k])
        fast.rollback(n - k)
        for i, (kc, vc) in owned_kv(fast, s, k).items():
            same(kv[i][0].float(), kc.float(), f"layer {i} keys")
            same(kv[i][1].float(), vc.float(), f"layer {i} values")
        want = torch.cat([fast.step(more).float(), fast.step([more[0]]).float()])
        same(after, want, f"n={n}: steps after keep_path")


def test_tree_rows():
    depth, anc = tree_rows([-1, 0, 0, 1, 3], 5, 8)
    assert depth.tolist() == [0, 1, 1, 2, 3, 4, 5, 6]
    assert anc.tolist()[:5] == [0b1, 0b11, 0b101, 0b1011, 0b11011]
    assert anc.tolist()[7] == 0b11111011  # padding rows continue a chain from the last row
    _, anc = tree_rows(list(range(-1, 63)), 64, 64)
    assert anc[63] == -1  # all 64 bits
    for bad in ([0, 0], [-1, 1], [-1, 0, 3]):
        with pytest.raises(ValueError):
            tree_rows(bad, len(bad), 4)


def test_tree_paths():
    paths = tree_paths([-1, 0, 0, 1, 3], 5, 7)
    assert paths[4, :4].tolist() == [0, 1, 3, 4] and paths[2, :2].tolist() == [0, 2]
    assert paths[6, :7].tolist() == [0, 1, 3, 4, 5, 6, 0]  # padding rows continue a chain from the last row
    chain = tree_paths(list(range(-1, 63)), 64, 64)
    assert all(chain[t, :t + 1].tolist() == list(range(t + 1)) for t in range(64))  # a chain: row j at depth j


def test_keep_path_refuses_a_non_path():
    fast = FastTarget(tiny_gemma4(seed=1, sliding_window=8), max_len=128, prefill_chunk=16, capture=False,
                      min_kv_len=16)
    fast.prefill(prompt_of(20, 512))
    fast.step([5, 6, 7, 8], [-1, 0, 0, 1])
    for bad in ([1], [0, 2, 3], [0, 1, 2]):
        with pytest.raises(ValueError):
            fast.keep_path(bad)
    fast.keep_path([0, 1, 3])
    assert fast.position == 23
    with pytest.raises(ValueError):  # only right after a step
        fast.keep_path([0])


def test_tree_step_equals_chain_fp32_cpu():
    tiny = tiny_gemma4(seed=1, sliding_window=8)
    fast = FastTarget(tiny, max_len=320, prefill_chunk=16, capture=False, min_kv_len=16)
    assert fast.supports_tree

    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=what)
    check_trees(fast, tiny.config.vocab_size, close, [(6, None), (16, 3), (40, 2), (64, None)])


@needs_cuda
@pytest.mark.parametrize("quant", [False, True])
def test_tree_step_equals_chain_cuda(quant):
    """Random trees in every bucket up to 64 (deep ones past the sliding window of 8, wide ones):
    each row's logits are a chain step's bit for bit, and so is everything after keep_path."""
    model = cuda_model(torch.bfloat16, quant=quant)
    fast = FastTarget(model, max_len=512, prefill_chunk=16, min_kv_len=64)
    assert fast.step_kernels, fast.step_kernel_note

    def equal(a, b, what):
        assert torch.equal(a, b), what
    check_trees(fast, model.config.vocab_size, equal,
                [(2, None), (3, None), (7, 2), (16, None), (16, 1), (29, 3), (32, None), (50, 4), (64, None), (64, 2)],
                seed=int(quant))


@needs_cuda
@pytest.mark.parametrize("quant", [False, True])
def test_engine_token_trees_equal_plain_cuda(quant):
    """The engine verifying token trees on the fast path's step kernels (supports_tree, as on the
    CPU int8 path): greedy and sampled output equal plain decoding's, token for token."""
    from tests.test_sampled_drafting import PRESETS

    model = cuda_model(torch.bfloat16, quant=quant)
    fast = FastTarget(model, max_len=512, prefill_chunk=16, min_kv_len=64)
    assert fast.step_kernels, fast.step_kernel_note
    engine = engine_for(model, backend=fast, prefix_cache=False)
    vocab = model.config.vocab_size
    trees = 0
    for i, (plen, preset) in enumerate([(9, {}), (40, {}), (100, {})] + [(30, p) for p in PRESETS]):
        prompt = prompt_of(plen, vocab, seed=i)
        seed = {"seed": 40 + i} if preset else {}
        plain, *_ = run(engine, prompt, max_tokens=60, draft=False, **seed, **preset)
        engine.set_drafter(TreeOracle(plen, plain, vocab, 0.4, seed=i))
        got, _, _, stats = run(engine, prompt, max_tokens=60, **seed, **preset)
        engine.set_drafter(None)
        assert got == plain, (plen, preset, first_divergence(got, plain))
        trees += stats.tree_steps
    assert trees > 0
