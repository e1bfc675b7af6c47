"""The engine's incremental detokenization (server/engine.py TextStream) on the bundled tokenizer:
its decode through the fast tokenizer's own Rust call gives exactly the text, stop-string cuts and
held-back tails that transformers' `decode` gives, token by token, on text, special tokens and
random ids with byte-fallback pieces (split UTF-8 characters)."""
from __future__ import annotations

import random

import pytest

from server.engine import TextStream, _raw_decode


@pytest.fixture(scope="module")
def tokenizer():
    from common.tokenizer import load_tokenizer

    return load_tokenizer()


class _TransformersDecode:
    """The tokenizer seen only through transformers' decode (what TextStream called before)."""

    def __init__(self, tokenizer):
        self._tokenizer_of = tokenizer

    def decode(self, ids, skip_special_tokens):
        return self._tokenizer_of.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream_states(tokenizer, tail: list[int], ids: list[int], stops: tuple[str, ...]) -> list[tuple]:
    stream = TextStream(tokenizer, stops, tail)
    states = []
    for token in ids:
        hit = stream.add(token)
        states.append((stream.text, hit, stream.stopped_by, stream.take(final=False)))
        if hit:
            break
    states.append(stream.take(final=True))
    return states


def _sequences(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    texts = ["Hello, wörld! 你好，世界 🐟🐟\n\tdef f(x):\n    return {'a': [1, 2]}",
             "<start_of_turn>model\ncall:get_weather{city:<escape>Paris<escape>}<end_of_turn>",
             "  leading spaces  and   gaps", "ÄÖÜ ß € ∑ ≈ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 END"]
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    vocab = len(tokenizer)
    byte_pieces = [i for i in range(vocab) if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_pieces) == 256
    for _ in range(count):
        n = rng.randint(1, 40)
        sequences.append([rng.choice(byte_pieces) if rng.random() < 0.3 else rng.randrange(vocab) for _ in range(n)])
    return sequences


def test_rust_decode_streams_what_transformers_decode_streams(tokenizer):
    assert tokenizer.is_fast and not tokenizer.clean_up_tokenization_spaces  # the Rust call is taken
    rng = random.Random(1)
    sequences = _sequences(tokenizer, 400, seed=0)
    for ids in sequences:
        tail = rng.choice(sequences)[-4:] if rng.random() < 0.8 else []
        stops = rng.choice([(), ("END",), ("ld", "<end_of_turn>"), ("\n",)])
        assert _stream_states(tokenizer, tail, ids, stops) == \
            _stream_states(_TransformersDecode(tokenizer), tail, ids, stops), (tail, ids, stops)


def test_decode_falls_back_where_transformers_adds_to_it(tokenizer):
    import copy

    ids = tokenizer.encode("a , b .", add_special_tokens=False)
    rust = tokenizer._tokenizer
    assert _raw_decode(tokenizer)(ids) == rust.decode(ids, skip_special_tokens=False) == "a , b ."
    calls = []

    def counted(tok):  # the tokenizer's own decode, counting its calls (an instance attribute: its class unchanged)
        decode = tok.decode
        tok.decode = lambda ids, **kwargs: calls.append(1) or decode(ids, **kwargs)
        return tok

    assert _raw_decode(counted(copy.copy(tokenizer)))(ids) == "a , b ." and calls == []  # the Rust call
    cleaning = counted(copy.copy(tokenizer))  # transformers' clean-up of spaces on: its decode decides
    cleaning.clean_up_tokenization_spaces = True
    assert _raw_decode(cleaning)(ids) == tokenizer.decode(ids, skip_special_tokens=False) and calls == [1]
    own = copy.copy(tokenizer)  # a class with a _decode of its own: that one
    own.__class__ = type("OwnDecode", (type(tokenizer),), {"_decode": lambda self, *args, **kwargs: "own"})
    assert _raw_decode(own)(ids) == "own"
    slow = _TransformersDecode(tokenizer)  # no Rust tokenizer at all: its decode
    assert _raw_decode(slow)(ids) == tokenizer.decode(ids, skip_special_tokens=False)
