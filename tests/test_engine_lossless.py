"""Lossless proof: drafted output equals plain greedy output token for token.

Three layers: (b) tiny random-init Gemma 4 models (no weights needed; sliding window 8 so rollback
crosses it, KV-shared layers, a quanto int4 variant); (c) stop tokens, stop strings and max_tokens
with drafts; (a) the bundled Gemma 3 270M model in fp32 on CPU (`slow`), 20+ prompts including
prompts longer than its 512-token sliding window, plain output also checked against
`model.generate(do_sample=False)`. The drafters are adversarial on purpose: the true greedy
continuation with injected errors (rejections at every draft position), random tokens, and prompt
lookup. In reduced precision (bf16, int4) a batched verify may legitimately disagree with a
one-token step; there the divergence rate is measured and bounded instead of asserted to be zero.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ngram.draft import EMPTY_DRAFT, Draft
from server.engine import Engine, EngineConfig, GenerationParams
from server.model_loading import LoadedTarget
from server.sampling import SamplingParams


def _draft(tokens, source="test", match_length=0) -> Draft:
    tokens = np.asarray(tokens, dtype=np.int32)
    return Draft(tokens, np.ones(len(tokens), dtype=np.float32), source, match_length)


class _Session:
    def __init__(self, propose):
        self.propose = propose
        self.fed = []

    def feedback(self, drafted: int, accepted: int) -> None:
        assert 0 <= accepted <= drafted
        self.fed.append((drafted, accepted))

    def prepare(self, context_ids) -> None:
        pass

    def finish(self, context_ids=None) -> None:
        pass


class OracleWithErrors:
    """Proposes the known greedy continuation with wrong tokens injected at random positions."""

    def __init__(self, prompt_len: int, reference: list[int], vocab: int, error_rate: float, seed: int = 0):
        self.prompt_len, self.reference, self.vocab = prompt_len, reference, vocab
        self.error_rate, self.rng = error_rate, np.random.default_rng(seed)

    def session(self):
        def propose(context, max_tokens):
            pos = len(context) - self.prompt_len
            out = list(self.reference[pos:pos + max_tokens])
            for i in range(len(out)):
                if self.rng.random() < self.error_rate:
                    out[i] = (out[i] + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab
            return _draft(out, "oracle")
        return _Session(propose)


class TreeOracle:
    """A token tree: a main chain of the known continuation with errors, then branches, each off a
    random node of the tree so far, holding either the right continuation there or random tokens.
    Laid out as ngram.draft says (main chain first, parents before children)."""

    def __init__(self, prompt_len: int, reference: list[int], vocab: int, error_rate: float, seed: int = 0):
        self.prompt_len, self.reference, self.vocab = prompt_len, reference, vocab
        self.error_rate, self.rng = error_rate, np.random.default_rng(seed)

    def session(self):
        def propose(context, max_tokens):
            rng, ref = self.rng, self.reference[len(context) - self.prompt_len:]
            chain = int(rng.integers(0, max_tokens + 1))
            tokens, parents, depth = [], [], []
            for i in range(min(chain, len(ref))):
                wrong = rng.random() < self.error_rate
                tokens.append((ref[i] + 1 + int(rng.integers(self.vocab - 1))) % self.vocab if wrong else ref[i])
                parents.append(i - 1)
                depth.append(i + 1)
            while len(tokens) < max_tokens and rng.random() < 0.8:
                at = int(rng.integers(-1, len(tokens)))  # the branch's parent (-1: the pending token)
                d = 0 if at < 0 else depth[at]
                for k in range(int(rng.integers(1, 4))):
                    if len(tokens) >= max_tokens:
                        break
                    right = d + k < len(ref) and rng.random() < 0.5
                    tokens.append(ref[d + k] if right else int(rng.integers(0, self.vocab)))
                    parents.append(at if k == 0 else len(tokens) - 2)
                    depth.append(d + k + 1)
            if not tokens:
                return _draft([], "tree")
            return Draft(np.asarray(tokens, dtype=np.int32), np.ones(len(tokens), dtype=np.float32), "tree", 0,
                         parents)
        return _Session(propose)


class RandomDrafter:
    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def session(self):
        def propose(context, max_tokens):
            n = int(self.rng.integers(0, max_tokens + 1))
            return _draft(self.rng.integers(0, self.vocab, n), "random")
        return _Session(propose)


class PromptLookup:
    """The last 1-3 context tokens matched against their latest earlier occurrence."""

    def session(self):
        def propose(context, max_tokens):
            ctx = np.asarray(context)
            for n in (3, 2, 1):
                if len(ctx) <= n:
                    continue
                tail = ctx[-n:]
                for start in range(len(ctx) - n - 1, -1, -1):
                    if np.array_equal(ctx[start:start + n], tail):
                        cont = ctx[start + n:start + n + max_tokens]
                        if len(cont):
                            return _draft(cont, "context", n)
            return EMPTY_DRAFT
        return _Session(propose)


class IdTokenizer:
    """Decodes token i as '<i>' so that text bookkeeping runs without a real vocabulary."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{int(i)}>" for i in ids)


def tiny_gemma4(seed: int = 0, sliding_window: int = 8, dtype=torch.float32, **overrides):
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                  num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                  sliding_window=sliding_window, max_position_embeddings=4096,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**kwargs)).to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: let every run reach max_tokens
    return model


# ---------------------------------------------------------------- helpers

def run(engine, prompt, **params):
    """Generate with GenerationParams fields, SamplingParams' fields (temperature, top_p, seed, ...) among them."""
    sampling = {k: params.pop(k) for k in list(params) if k in SamplingParams.__dataclass_fields__}
    tokens, text, chunks = [], "", []
    for chunk in engine.generate(prompt, GenerationParams(**params, sampling=SamplingParams(**sampling))):
        tokens += chunk.token_ids
        text += chunk.text
        chunks.append(chunk)
    assert all(c.finish_reason is None for c in chunks[:-1])
    return tokens, text, chunks[-1].finish_reason, chunks[-1].stats


def engine_for(model, tokenizer=None, drafter=None, backend=None, **config):
    config.setdefault("adaptive", False)  # verify every draft in full: the strictest test
    config.setdefault("cpu_int8", False)  # these tests prove transformers' path; tests/test_cpu_model.py the int8 one
    target = LoadedTarget(model, tokenizer or IdTokenizer(), "test", "none", next(model.parameters()).dtype,
                          torch.device("cpu"), [])
    return Engine(target, drafter, EngineConfig(**config), backend=backend)


def prompts_for(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[2] + rng.integers(3, vocab, n - 1).tolist() for n in lengths]


def drafters(prompt_len, reference, vocab, seed):
    return {"oracle": OracleWithErrors(prompt_len, reference, vocab, 0.0, seed),
            "oracle-err-0.2": OracleWithErrors(prompt_len, reference, vocab, 0.2, seed),
            "oracle-err-0.6": OracleWithErrors(prompt_len, reference, vocab, 0.6, seed),
            "random": RandomDrafter(vocab, seed), "prompt-lookup": PromptLookup(),
            "tree-oracle-err-0.5": TreeOracle(prompt_len, reference, vocab, 0.5, seed)}


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# ---------------------------------------------------------------- (b) tiny Gemma 4, no weights

TINY_LENGTHS = (2, 5, 8, 9, 17, 40, 70)  # the window is 8: most prompts already overflow it


@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma4()


@pytest.fixture
def one_thread():
    """Tiny models run 3-9x faster on one thread (measured: 16 vs 52-150 ms per step on 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


tiny_test = pytest.mark.usefixtures("one_thread")


@tiny_test
@pytest.mark.parametrize("flags", [{"gpu_memory_mb": 4096}, {"fast_max_context": 4096},
                                   {"gpu_memory_mb": 4096, "fast_max_context": 4096}, {"lm_head": "int8"},
                                   {"lm_head": "bf16"}])
def test_gpu_sizing_flags_are_refused_off_the_gpu_fast_path(tiny, flags):
    """--gpu-memory-mb, --fast-max-context and --lm-head (but auto) shape the GPU fast path: on a run
    without it (here the CPU) they are refused with the reason, not ignored."""
    with pytest.raises(ValueError, match="the GPU fast path, which this run does not use") as refused:
        engine_for(tiny, **flags)
    for flag in flags:
        assert "--" + flag.replace("_", "-") in str(refused.value)
    assert "no CUDA" in str(refused.value)


def test_tiny_plain_matches_hf_generate(tiny):
    engine = engine_for(tiny)
    for prompt in prompts_for(512, TINY_LENGTHS):
        ours, _, finish, stats = run(engine, prompt, max_tokens=30, draft=False)
        ref = tiny.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):]
        assert ours == ref.tolist() and finish == "length" and stats.plain_steps == 29


@tiny_test
def test_tiny_drafted_equals_plain_fp32(tiny):
    engine = engine_for(tiny)
    for seed, prompt in enumerate(prompts_for(512, TINY_LENGTHS)):
        plain, plain_text, _, _ = run(engine, prompt, max_tokens=40, draft=False)
        for name, drafter in drafters(len(prompt), plain, 512, seed).items():
            engine.set_drafter(drafter)
            got, text, finish, stats = run(engine, prompt, max_tokens=40)
            assert got == plain, (name, len(prompt), first_divergence(got, plain))
            assert text == plain_text and finish == "length" and stats.completion_tokens == 40
            assert stats.verify_steps > 0, name
    totals = engine.totals()
    assert totals["accepted_tokens"] < totals["drafted_tokens"]  # rejections did happen


@tiny_test
def test_tiny_counters_add_up(tiny):
    prompt = prompts_for(512, [12])[0]
    engine = engine_for(tiny)
    plain, *_ = run(engine, prompt, max_tokens=40, draft=False)
    engine.set_drafter(OracleWithErrors(len(prompt), plain, 512, 0.3, seed=1))
    got, _, _, s = run(engine, prompt, max_tokens=40)
    assert got == plain
    # every forward after the prefill yields 1 token plus the accepted drafted ones
    assert s.plain_steps + s.verify_steps + s.accepted_tokens + 1 == s.completion_tokens
    assert s.drafts >= s.verify_steps > 0 and s.accepted_tokens <= s.drafted_tokens


@tiny_test
def test_tiny_adaptive_policy_is_lossless(tiny):
    from server.cost_model import DraftPolicy

    prompt = prompts_for(512, [30])[0]
    engine = engine_for(tiny)
    plain, *_ = run(engine, prompt, max_tokens=60, draft=False)
    steep = np.concatenate([[0.0], 1.0 + 0.5 * np.arange(16)])  # drafting rarely pays
    for curve in (steep, np.ones(17)):
        engine = engine_for(tiny, drafter=RandomDrafter(512, 3), adaptive=True, cost_curve=curve)
        got, _, _, stats = run(engine, prompt, max_tokens=60)
        assert got == plain
    assert stats.verify_steps > 0


@tiny_test
def test_tiny_int4_and_bf16_divergence_is_bounded():
    """Reduced precision: verify in one batch vs one token at a time may round differently.

    Measured, not hidden: the rate of requests whose drafted output differs from plain decoding and
    the mean position of the first difference are printed; the bound is loose on purpose (random
    weights give near-tied logits, the worst case for this).
    """
    from optimum.quanto import freeze, qint4, quantize

    report = {}
    for label in ("bf16", "int4"):
        if label == "bf16":
            model = tiny_gemma4(seed=1, dtype=torch.bfloat16)
        else:
            model = tiny_gemma4(seed=1, hidden_size=128, intermediate_size=256)
            quantize(model, weights=qint4, exclude=["lm_head"])
            freeze(model)
        engine = engine_for(model)
        differ, positions, total = 0, [], 0
        for seed, prompt in enumerate(prompts_for(512, (5, 9, 40, 70), seed=5)):
            plain, *_ = run(engine, prompt, max_tokens=40, draft=False)
            for drafter in drafters(len(prompt), plain, 512, seed).values():
                engine.set_drafter(drafter)
                got, *_ = run(engine, prompt, max_tokens=40)
                total += 1
                pos = first_divergence(got, plain)
                if pos is not None:
                    differ += 1
                    positions.append(pos)
        report[label] = (differ / total, float(np.mean(positions)) if positions else None)
    print("drafted-vs-plain divergence (rate, mean first position):", report)
    for rate, _ in report.values():
        assert rate <= 0.5


# ---------------------------------------------------------------- (c) stop conditions with drafts

@tiny_test
def test_stop_token_and_max_tokens_exact_with_drafts(tiny):
    prompt = prompts_for(512, [20])[0]
    engine = engine_for(tiny)
    plain, *_ = run(engine, prompt, max_tokens=40, draft=False)
    oracle = OracleWithErrors(len(prompt), plain, 512, 0.0)
    stop = plain[17]
    cut = plain.index(stop)
    for draft in (False, True):
        engine.set_drafter(oracle)
        got, text, finish, stats = run(engine, prompt, max_tokens=40, stop_token_ids=frozenset({stop}), draft=draft)
        assert got == plain[:cut] and finish == "stop" and stats.completion_tokens == cut + 1
        assert stop not in got
        for n in (1, 2, 3, 7, 16, 17, 33):
            got, _, finish, stats = run(engine, prompt, max_tokens=n, draft=draft)
            assert got == plain[:n] and finish == "length" and stats.completion_tokens == n


@tiny_test
def test_stop_strings_exact_with_drafts(tiny):
    prompt = prompts_for(512, [20])[0]
    engine = engine_for(tiny)
    plain, plain_text, *_ = run(engine, prompt, max_tokens=40, draft=False)
    # a stop string inside token 15's text, and one spanning tokens 20 and 21
    inside = f"<{plain[15]}>"[1:-1]
    spanning = f"{plain[20]}><{plain[21]}"
    for stop in (inside, spanning):
        cut = plain_text.index(stop)
        outputs = []
        for draft in (False, True):
            engine.set_drafter(OracleWithErrors(len(prompt), plain, 512, 0.0))
            tokens, text, finish, stats = run(engine, prompt, max_tokens=40, stop_strings=("never-seen", stop),
                                              draft=draft)
            assert text == plain_text[:cut] and finish == "stop" and stop not in text
            assert stats.accepted_tokens <= stats.completion_tokens  # (none accepted past the stop string counted)
            outputs.append(tokens)
        assert outputs[0] == outputs[1]


@tiny_test
def test_chunks_never_leak_a_stop_string_prefix(tiny):
    prompt = prompts_for(512, [20])[0]
    engine = engine_for(tiny, drafter=PromptLookup())
    plain, plain_text, *_ = run(engine, prompt, max_tokens=30, draft=False)
    stop = f"<{plain[25]}><NOPE"  # its first half appears, the stop string never completes
    pieces = [c.text for c in engine.generate(prompt, GenerationParams(max_tokens=30, stop_strings=(stop,)))]
    assert "".join(pieces) == plain_text


@tiny_test
def test_cancel_stops_between_steps(tiny):
    prompt = prompts_for(512, [10])[0]
    engine = engine_for(tiny)
    calls = []
    chunks = list(engine.generate(prompt, GenerationParams(max_tokens=30, draft=False),
                                  cancelled=lambda: len(calls.append(1) or calls) >= 3))
    assert len(chunks) == 3 and chunks[-1].finish_reason is None


# ---------------------------------------------------------------- (a) the bundled 270M model, fp32, CPU

SNIPPETS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n{"name": "get_weather", "arguments": {"city": "',
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Question: What is the capital of France?\nAnswer:",
    "Once upon a time, in a small village by the sea, there lived",
    "import numpy as np\nimport torch\nimport",
    "<start_of_turn>user\nList three primary colours.<end_of_turn>\n<start_of_turn>model\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY",
    "The mitochondria is the powerhouse of the cell because",
    "ls -la /home/user\ncd /home/user/projects\nls -la",
    '<tool_call>{"name": "search", "query": "weather in Tokyo"}</tool_call>\n<tool_call>{"name": "search", "query": "',
    "Dear Sir or Madam,\n\nI am writing to",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "To solve 3x + 5 = 20, we first subtract",
    "Monday, Tuesday, Wednesday,",
    "user: book a table for two at 7pm\nassistant: call book_table(people=2, time=\"19:00\")\nuser: book a table for four at 8pm\nassistant:",
    "In 1969, Apollo 11",
]
LONG_BLOCK = ('{"type": "function", "function": {"name": "read_file", "description": "Read a file from disk and '
              'return its contents", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}\n')


@pytest.fixture(scope="module")
def gemma270m():
    from server.model_loading import load_target

    return load_target(None)


def _long_prompts(tokenizer):
    prose = " ".join(f"Step {i}: the operator checks gauge {i % 7} and records the reading." for i in range(60))
    texts = [LONG_BLOCK * 14 + '{"name": "read_file", "arguments": {"path": "',
             prose + " Step 60:",
             "def f%d(x):\n    return x * %d\n\n" * 0 + "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(50))]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    assert all(len(p) > 560 for p in prompts), [len(p) for p in prompts]
    return prompts


@pytest.mark.slow
def test_270m_drafted_equals_plain(gemma270m):
    tok = gemma270m.tokenizer
    prompts = [tok(t)["input_ids"] for t in SNIPPETS] + _long_prompts(tok)
    assert len(prompts) >= 20
    engine = Engine(gemma270m, None, EngineConfig(adaptive=False, cpu_int8=False))  # transformers' fp32 forward
    vocab = gemma270m.model.config.vocab_size
    kinds = ["oracle-err-0.2", "prompt-lookup", "random", "oracle-err-0.6"]
    # 12 tokens a prompt (24 before): transformers' fp32 forward is the slowest path CI runs, and on a
    # CPU without AVX-512 this test alone took 2.4 minutes; 23 prompts x 4 drafters still cover it
    for i, prompt in enumerate(prompts):
        plain, plain_text, finish, _ = run(engine, prompt, max_tokens=12, draft=False)
        if i % 7 == 0 or len(prompt) > 512:
            ref = gemma270m.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
            assert plain == [t for t in ref if t not in engine.eos_token_ids][:len(plain)], i
        kind = kinds[i % len(kinds)]
        engine.set_drafter(drafters(len(prompt), plain, vocab, i)[kind])
        got, text, got_finish, stats = run(engine, prompt, max_tokens=12)
        assert got == plain, (i, kind, len(prompt), first_divergence(got, plain))
        assert text == plain_text and got_finish == finish
    totals = engine.totals()
    print("270M totals:", totals)
    assert totals["verify_steps"] > 0 and totals["accepted_tokens"] < totals["drafted_tokens"]
