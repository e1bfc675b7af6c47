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


def _cut(text: str, stops=(), text_stops=(), calls=("<|tool_call>", "<tool_call|>"), in_call=False):
    """Feed `text` byte by byte as the engine does (it stops at the first True): the text kept and the stop."""
    from tests.test_server_protocol import ByteTokenizer

    stream = TextStream(ByteTokenizer(), stops, [], text_stops, calls, in_call)
    next((b for b in text.encode() if stream.add(b)), None)
    return stream.take(final=True), stream.stopped_by


def test_a_requests_stop_strings_do_not_cut_a_tool_call():
    """A request's stop strings (`text_stops`) end the text, not a call: inside a call's markers they are
    not matched (a call cut there came back as an empty call), before and after one they are; the
    format's end markers (`stops`) end generation anywhere, a call included; without markers (a
    chat template's own call syntax) a request's stop strings match everywhere, as before."""
    call = "<|tool_call>call:read_file{path:<|\"|>a: b<|\"|>}<tool_call|>"
    assert _cut(call + " done: yes", text_stops=(":",)) == (call + " done", ":")
    assert _cut("Sure: " + call, text_stops=(":",)) == ("Sure", ":")
    assert _cut(call + call, text_stops=(":", "}")) == (call + call, None)
    # the prompt ended inside a call (a forced call's start): inside until its close marker
    assert _cut("read_file{path:1}<tool_call|>ok: x", text_stops=(":",), in_call=True) == \
        ("read_file{path:1}<tool_call|>ok", ":")
    assert _cut("read_file{path:1}<tool_call|>ok: x", text_stops=(":",)) == ("read_file{path", ":")
    # the format's end markers end generation inside a call too
    assert _cut("<|tool_call>call:f{a<turn|>", stops=("<turn|>",), text_stops=(":",)) == \
        ("<|tool_call>call:f{a", "<turn|>")
    assert _cut(call, text_stops=(":",), calls=None) == ("<|tool_call>call", ":")
    # the first stop in the text wins, whichever list it is in
    assert _cut("ab END: x", stops=("END",), text_stops=(":",)) == ("ab ", "END")
