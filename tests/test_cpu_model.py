"""The CPU int8 path (server/cpu_model.py, cpu_backend.py): close to transformers' math, batch-invariant
bit for bit, and lossless through the engine (drafted equals plain, prefix cache on and off), on a
tiny random Gemma 3 (sliding window 8, so prompts cross it) and, marked slow, on the bundled model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from server import cpu_kernels
from server.cpu_backend import CpuBackend
from server.cpu_model import CpuGemma, quantize_weight
from tests.test_engine_lossless import drafters, engine_for, first_divergence, prompts_for, run


def tiny_gemma3(seed: int = 0):
    from transformers import Gemma3ForCausalLM
    from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                           max_position_embeddings=4096, query_pre_attn_scalar=32,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # random norms, so that (1 + w) is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def tiny():
    model = tiny_gemma3()
    return model, CpuGemma.from_hf(model)


def test_weights_quantize_like_q8_0():
    w = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    codes, scales = quantize_weight(w)
    assert codes.dtype == np.int8 and scales.shape == (4, 2)
    assert np.abs(codes).max() == 127
    assert np.abs(codes.reshape(4, 2, 32) * scales[:, :, None] - w.reshape(4, 2, 32)).max() <= scales.max() / 2 + 1e-7
    again, again_scales = quantize_weight((codes.reshape(4, 2, 32) * scales[:, :, None]).reshape(4, 64))
    assert np.array_equal(again, codes) and np.array_equal(again_scales, scales)  # a Q8_0 tensor comes back exactly


def test_logits_close_to_transformers(tiny):
    model, cpu = tiny
    ids = prompts_for(512, [30], seed=1)[0]  # past the window of 8
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    out = cpu.forward(ids, 0, cpu.new_cache(64))
    assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max()
    assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.9


def _assert_verify_equals_one_token_steps(cpu, seed: int) -> None:
    ids = prompts_for(512, [40], seed=seed)[0]
    batched = cpu.forward(ids, 0, cpu.new_cache(64))
    cache = cpu.new_cache(64)
    cpu.forward(ids[:20], 0, cache)
    rows = [cpu.forward(ids[j:j + 1], j, cache)[0] for j in range(20, 40)]
    assert np.array_equal(np.stack(rows), batched[20:])


def test_a_verify_equals_one_token_steps_bit_for_bit(tiny):
    _assert_verify_equals_one_token_steps(tiny[1], seed=2)


def _assert_tree_rows_equal_their_chains(cpu, seed: int) -> None:
    """Each row of a token-tree forward equals, bit for bit, the last row of its path's chain
    forward; keep_path leaves the cache a chain of the kept path would (the next step agrees)."""
    from server.cpu_model import tree_layout

    rng = np.random.default_rng(seed)
    ids = prompts_for(512, [30], seed=seed)[0]  # past the window of 8
    parents = [-1] + [int(rng.integers(0, j)) for j in range(1, 20)]
    step = rng.integers(3, 512, 20).tolist()
    cache = cpu.new_cache(64)
    cpu.forward(ids, 0, cache)
    tree = cpu.forward(step, 30, cache, parents=parents)
    _, ancestors = tree_layout(parents)
    paths = [[i for i in range(20) if int(ancestors[j]) >> i & 1] for j in range(20)]
    for j in range(20):
        chain = cpu.new_cache(64)
        cpu.forward(ids, 0, chain)
        rows = cpu.forward([step[i] for i in paths[j]], 30, chain)
        assert np.array_equal(tree[j], rows[-1]), j
    deepest = max(range(20), key=lambda j: len(paths[j]))
    cache.keep_path(30, paths[deepest])
    at = 30 + len(paths[deepest])
    chain = cpu.new_cache(64)
    cpu.forward(ids + [step[i] for i in paths[deepest]], 0, chain)
    assert np.array_equal(cpu.forward([7, 8], at, cache), cpu.forward([7, 8], at, chain))


def test_a_tree_row_equals_its_chain_bit_for_bit(tiny):
    _assert_tree_rows_equal_their_chains(tiny[1], seed=21)


def test_threads_do_not_change_a_bit(tiny):
    if not cpu_kernels.AVAILABLE:
        pytest.skip("the C kernels are not built")
    _, cpu = tiny
    ids = prompts_for(512, [24], seed=3)[0]
    cpu_kernels.set_threads(1)
    one = cpu.forward(ids, 0, cpu.new_cache(64))
    cpu_kernels.set_threads(2)
    assert np.array_equal(cpu.forward(ids, 0, cpu.new_cache(64)), one)


def test_logits_a_caller_keeps_are_never_overwritten_by_later_forwards(tiny):
    """Forwards write their logits into reused buffers (server/reused_arrays.py): every buffer a
    caller still holds a view of stays untouched, and a dropped one is reused."""
    _, cpu = tiny
    min_bytes, cpu.logits_buffers.min_bytes = cpu.logits_buffers.min_bytes, 0  # the tiny vocabulary's logits are small
    try:
        ids = prompts_for(512, [24], seed=5)[0]
        first = cpu.forward(ids, 0, cpu.new_cache(64))
        kept = first[3:9]  # a view, as a lane keeps its rows
        expected = kept.copy()
        del first
        for seed in range(4):
            other = prompts_for(512, [24], seed=6 + seed)[0]
            later = cpu.forward(other, 0, cpu.new_cache(64))
            assert not np.shares_memory(later, kept)
            assert np.array_equal(kept, expected)
            del later
        assert cpu.logits_buffers.reused >= 3
    finally:
        cpu.logits_buffers.min_bytes = min_bytes


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_drafted_equals_plain_through_the_engine(tiny, prefix_cache):
    model, cpu = tiny
    budget = 64 * 2**20 if prefix_cache else 0
    engine = engine_for(model, backend=CpuBackend(cpu, 4096, budget, max_step=17), prefix_cache=prefix_cache)
    for prompt in prompts_for(512, (3, 9, 17, 40), seed=4):
        plain, *_ = run(engine, prompt, max_tokens=24, draft=False)
        for name, drafter in drafters(len(prompt), plain, 512, seed=5).items():
            engine.set_drafter(drafter)
            got, _, _, stats = run(engine, prompt, max_tokens=24)
            assert got == plain, (name, first_divergence(got, plain))
            assert stats.tree_steps > 0 or not name.startswith("tree")  # trees were verified as trees
        # the next turn of the conversation reuses this one's cache: same output as computed afresh
        turn = prompt + plain + prompt[:5]
        again, _, _, stats = run(engine, turn, max_tokens=12, draft=False)
        fresh, *_ = run(engine, turn, max_tokens=12, draft=False, prefix_cache=False)
        assert again == fresh
        if prefix_cache:
            assert stats.cached_tokens > 0


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, top_p=0.95, seed=5)])
def test_stops_and_limits_exact_with_drafts_and_trees(tiny, sampling):
    """Drafted chains and token trees on the int8 path end exactly where plain decoding ends: at a stop
    token, at a stop string inside one token's text or spanning two, and at max_tokens, whatever the
    verify step accepted past that point (a tree's accepted path cut short included); greedy and
    seeded sampling."""
    from tests.test_engine_lossless import OracleWithErrors, TreeOracle

    model, cpu = tiny
    engine = engine_for(model, backend=CpuBackend(cpu, 4096, 0, max_step=17), prefix_cache=False)
    prompt = prompts_for(512, [30], seed=9)[0]
    plain, plain_text, *_ = run(engine, prompt, max_tokens=40, draft=False, **sampling)
    stop_token = plain[17]
    cut = plain.index(stop_token)
    accepted = trees = 0
    for make in (lambda: OracleWithErrors(len(prompt), plain, 512, 0.15, seed=1),
                 lambda: TreeOracle(len(prompt), plain, 512, 0.3, seed=2)):
        engine.set_drafter(make())
        got, _, finish, stats = run(engine, prompt, max_tokens=40, stop_token_ids=frozenset({stop_token}), **sampling)
        assert got == plain[:cut] and finish == "stop", first_divergence(got, plain)
        accepted, trees = accepted + stats.accepted_tokens, trees + stats.tree_steps
        for stop in (f"<{plain[15]}>"[1:-1], f"{plain[20]}><{plain[21]}"):  # inside a token; across two
            engine.set_drafter(make())
            _, text, finish, stats = run(engine, prompt, max_tokens=40, stop_strings=("never-seen", stop), **sampling)
            assert text == plain_text[:plain_text.index(stop)] and finish == "stop"
            accepted += stats.accepted_tokens
        for n in (1, 2, 7, 16, 17, 33):
            engine.set_drafter(make())
            got, _, finish, stats = run(engine, prompt, max_tokens=n, **sampling)
            assert got == plain[:n] and finish == "length" and stats.completion_tokens == n
    assert accepted > 0 and trees > 0  # drafts were verified, as chains and as trees


def test_sampled_token_trees_equal_plain(tiny):
    """Sampled requests verified as token trees: for the same seed, the output of every preset
    (penalties included: a tree row sees its own path's tokens) equals plain decoding's."""
    from tests.test_engine_lossless import TreeOracle
    from tests.test_sampled_drafting import PRESETS

    model, cpu = tiny
    engine = engine_for(model, backend=CpuBackend(cpu, 4096, 0, max_step=17), prefix_cache=False)
    prompt = prompts_for(512, [40], seed=8)[0]
    trees = 0
    for i, preset in enumerate(PRESETS):
        plain, *_ = run(engine, prompt, max_tokens=30, draft=False, seed=40 + i, **preset)
        engine.set_drafter(TreeOracle(len(prompt), plain, 512, 0.4, seed=i))
        got, _, _, stats = run(engine, prompt, max_tokens=30, seed=40 + i, **preset)
        engine.set_drafter(None)
        assert got == plain, (preset, first_divergence(got, plain))
        trees += stats.tree_steps
    assert trees > 0


@pytest.mark.slow
def test_bundled_model_drafted_equals_plain():
    from server.model_loading import load_target
    from server.engine import Engine, EngineConfig
    from tests.test_engine_lossless import OracleWithErrors

    target = load_target(None)
    engine = Engine(target, None, EngineConfig(cpu_int8=True, adaptive=False, cost_cache=None))
    assert isinstance(engine.backend, CpuBackend)
    tok = target.tokenizer
    for text in ["def fibonacci(n):\n    if n < 2:", '{"name": "get_weather", "arguments": {"city": "',
                 "The quick brown fox jumps. " * 100]:  # the last one crosses the 512-token window
        prompt = tok(text)["input_ids"]
        assert len(prompt) > 512 or text[:3] != "The"
        plain, *_ = run(engine, prompt, max_tokens=40, draft=False)
        for err in (0.0, 0.3):
            engine.set_drafter(OracleWithErrors(len(prompt), plain, 262144, err, seed=7))
            got, *_ = run(engine, prompt, max_tokens=40)
            assert got == plain, (text[:20], err, first_divergence(got, plain))


# ---------------------------------------------------------------- Gemma 4 text (tiny, random)

@pytest.fixture(scope="module")
def tiny4():
    from tests.test_engine_lossless import tiny_gemma4

    # per-layer inputs of 32 (the int8 layout takes widths in 32s), KV-shared layers, a logit soft-cap
    model = tiny_gemma4(seed=3, hidden_size_per_layer_input=32, final_logit_softcapping=30.0)
    return model, CpuGemma.from_hf(model)


class FloatKernels:
    """The model's math with float matmuls on the int8 weights (no activation quantization): checks
    the forward's structure against transformers more tightly than the int8 kernels allow."""

    AVAILABLE = False

    @staticmethod
    def linear(x, lin, out=None):
        w = (lin.codes.astype(np.float64).reshape(lin.codes.shape[0], -1, 32) * lin.scales[:, :, None])
        result = (x.astype(np.float64) @ w.reshape(lin.codes.shape[0], -1).T).astype(np.float32)
        if out is not None:
            out[...] = result
        return result if out is None else out

    rms_norm = staticmethod(cpu_kernels.rms_norm_numpy)
    gelu_mul = staticmethod(cpu_kernels.gelu_mul_numpy)
    rope = staticmethod(cpu_kernels.rope_numpy)

    @staticmethod
    def attention(q, k_cache, v_cache, positions, window, scale):
        return cpu_kernels._attention_numpy(q, k_cache, v_cache, positions, window, scale, np.empty_like(q))

    @staticmethod
    def attention_many(calls):
        return [FloatKernels.attention(*call) for call in calls]


def test_gemma4_math_is_transformers(tiny4, monkeypatch):
    """With the weights kept exactly (float "codes", unit scales) and float matmuls, the forward is
    transformers' own to float rounding: per-layer inputs, KV-shared layers, the layer scalar,
    partial RoPE and the soft-cap included."""
    import server.cpu_model as cpu_model

    model, _ = tiny4
    monkeypatch.setattr(cpu_model, "quantize_weight",
                        lambda w: (w.astype(np.float32), np.ones((w.shape[0], w.shape[1] // 32), np.float32)))
    exact = CpuGemma.from_hf(model, kernels=FloatKernels)
    ids = prompts_for(512, [30], seed=11)[0]  # past the window of 8
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(exact.forward(ids, 0, exact.new_cache(64)) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


def test_gemma4_int8_logits_close_to_transformers(tiny4):
    model, cpu = tiny4
    ids = prompts_for(512, [30], seed=11)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    out = cpu.forward(ids, 0, cpu.new_cache(64))
    assert np.corrcoef(out.ravel(), ref.ravel())[0, 1] > 0.98


def test_gemma4_verify_equals_one_token_steps_bit_for_bit(tiny4):
    _assert_verify_equals_one_token_steps(tiny4[1], seed=12)


def test_gemma4_tree_row_equals_its_chain_bit_for_bit(tiny4):
    _assert_tree_rows_equal_their_chains(tiny4[1], seed=22)


def test_gemma4_drafted_equals_plain_through_the_engine(tiny4):
    model, _ = tiny4
    engine = engine_for(model, cpu_int8=True)  # the engine picks the CPU int8 path for Gemma 4 text too
    assert isinstance(engine.backend, CpuBackend), engine.notes
    for prompt in prompts_for(512, (3, 17, 40), seed=13):
        plain, *_ = run(engine, prompt, max_tokens=24, draft=False)
        for name, drafter in drafters(len(prompt), plain, 512, seed=14).items():
            engine.set_drafter(drafter)
            got, *_ = run(engine, prompt, max_tokens=24)
            assert got == plain, (name, first_divergence(got, plain))
