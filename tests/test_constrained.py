"""Constrained decoding (server.grammar on llguidance, server.tool_grammars, the engine's use of them).

Fast layer, no weights: a real byte-level tokenizer of 512 tokens (`ByteTokenizer` below: 6 special
tokens, the 256 bytes, 250 merged pieces) wrapped by llguidance's TokenizerWrapper, and the tiny
random Gemma 4 of tests.test_engine_lossless with the same vocabulary. It checks the matcher's
contract, the tool-call grammars against common.chat_format's own value syntax and parser (markers
as text, as the bundled tokenizer has them, and as special tokens, as Gemma 4's has them), and the
engine: every output follows its grammar, drafted output equals plain output token for token
(greedy and seeded sampling; drafts from the true continuation with errors, and random tokens),
and drafted tokens the grammar rejects are never verified.
Slow layer: the bundled Gemma 3 270M with its own tokenizer: JSON-schema outputs parse and validate,
json_object outputs parse, tool calls in the built-in Gemma 4 format parse to an offered tool, and
drafted equals plain under each constraint.
"""
from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest
import torch

from common.chat_format import CALL_CLOSE, CALL_OPEN, QUOTE, ChatFormat, format_value, parse_generated
from ngram.draft import Draft
from server.grammar import GrammarCompiler, GrammarError
from tests.test_engine_lossless import (OracleWithErrors, RandomDrafter, _Session, engine_for, gemma270m,  # noqa: F401
                                        one_thread, prompts_for, tiny_gemma4, tiny_test)


class ByteTokenizer:
    """A byte-level tokenizer: special tokens, every byte, then merged pieces; greedy longest match."""

    SPECIALS = ("<pad>", "<eos>", "<bos>", CALL_OPEN, CALL_CLOSE, QUOTE)
    VOCAB = 512
    eos_token_id, bos_token_id = 1, 2

    def __init__(self):
        merges = ['{"', '"}', '":', '": ', '", "', ', "', '","', '":"', "true", "false", "null", "call:",
                  "name", "city", "unit", "level", "low", "mid", "high", "  ", "\n", "\n  ", "    ", "[{", "}]"]
        letters = "etaoinshrdlcu"
        merges += [a + b for a in letters for b in letters] + [f"{i}" for i in range(10, 100)]
        pieces = [s.encode() for s in self.SPECIALS] + [bytes([b]) for b in range(256)]
        for m in dict.fromkeys(m.encode() for m in merges):
            if m not in pieces and len(pieces) < self.VOCAB:
                pieces.append(m)
        assert len(pieces) == self.VOCAB
        self.tokens = pieces
        self.special_token_ids = list(range(len(self.SPECIALS)))
        self._ids = {p: i for i, p in enumerate(pieces) if i >= len(self.SPECIALS)}
        self._longest = max(map(len, self._ids))

    def encode_bytes(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                if data[i:i + n] in self._ids:
                    out.append(self._ids[data[i:i + n]])
                    i += n
                    break
        return out

    def encode(self, text: str, specials: bool = True) -> list[int]:
        """Text to ids; with `specials`, the special tokens' names become those tokens."""
        out, rest = [], text
        while rest:
            hits = [(rest.find(s), i) for i, s in enumerate(self.SPECIALS) if specials and s in rest]
            if not hits:
                return out + self.encode_bytes(rest.encode())
            at, special = min(hits)
            out += self.encode_bytes(rest[:at].encode()) + [special]
            rest = rest[at + len(self.SPECIALS[special]):]
        return out

    def __call__(self, text):  # what llguidance's TokenizerWrapper calls: bytes in, ids out
        return self.encode_bytes(text if isinstance(text, bytes) else text.encode())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        keep = [int(i) for i in ids if not (skip_special_tokens and int(i) < len(self.SPECIALS))]
        return b"".join(self.tokens[i] for i in keep).decode("utf-8", errors="replace")


BYTE_TOKENIZER = ByteTokenizer()
_LL_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(BYTE_TOKENIZER))


def byte_compiler(markers_as_tokens: bool) -> GrammarCompiler:
    specials = {s: i for i, s in enumerate(ByteTokenizer.SPECIALS)} if markers_as_tokens else {}
    return GrammarCompiler(_LL_TOKENIZER, vocab_size=ByteTokenizer.VOCAB, special_tokens=specials)


def encode_for(markers_as_tokens: bool, text: str) -> list[int]:
    return BYTE_TOKENIZER.encode(text, specials=markers_as_tokens)


STATUS_SCHEMA = {"type": "object",
                 "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]},
                                "note": {"type": "null"}},
                 "required": ["ok", "level"], "additionalProperties": False,
                 "x-guidance": {"whitespace_flexible": False}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
            "filter": {"$ref": "#/$defs/filter"}},
        "required": ["query"],
        "$defs": {"filter": {"type": "object", "properties": {"min": {"type": "number"}, "exact": {"type": "boolean"},
                                                               "sub": {"anyOf": [{"$ref": "#/$defs/filter"},
                                                                                 {"type": "null"}]}}}}}}},
    {"type": "function", "function": {"name": "ping"}},
]
SWITCH_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}, "mode": {"enum": ["a", "b"]}}, "required": ["on"]}}}
    for name in ("lamp", "fan")]


def call_text(name: str, args: dict) -> str:
    return f"{CALL_OPEN}call:{name}{format_value(args)}{CALL_CLOSE}"


def check_status(obj) -> None:
    """STATUS_SCHEMA, checked by hand."""
    assert isinstance(obj, dict) and set(obj) <= {"ok", "level", "note"} and {"ok", "level"} <= set(obj), obj
    assert isinstance(obj["ok"], bool) and obj["level"] in ("low", "mid", "high") and obj.get("note") is None


# ---------------------------------------------------------------- the matcher's contract

def test_matcher_walks_a_schema_and_stops_where_it_is_complete():
    matcher = byte_compiler(False).json_schema(STATUS_SCHEMA).start(stop_token_ids=[1])
    ids = encode_for(False, '{"ok":true,"level":"mid"}')
    assert matcher.validate_tokens(ids) == len(ids) and matcher.consumed == 0  # validating changes nothing
    for token in ids:
        allowed = matcher.allowed()
        assert allowed[token] and not allowed[1]  # the stop token only where the grammar may end
        matcher.consume(token)
    assert matcher.is_accepting() and matcher.is_stopped()
    assert torch.nonzero(matcher.allowed()).flatten().tolist() == [1]
    with pytest.raises(GrammarError):
        matcher.consume(encode_for(False, "x")[0])


def test_stop_tokens_are_allowed_exactly_when_the_grammar_may_end():
    compiler = byte_compiler(False)
    a = encode_for(False, "a")[0]
    matcher = compiler.lark('start: "a"+').start(stop_token_ids=[7, 1])
    assert not matcher.allowed()[[1, 7]].any()
    matcher.consume(a)
    allowed = matcher.allowed()
    assert matcher.is_accepting() and not matcher.is_stopped()
    only_a = {i for i, piece in enumerate(BYTE_TOKENIZER.tokens) if i >= 6 and set(piece) == {ord("a")}}
    assert set(torch.nonzero(allowed).flatten().tolist()) == {1, 7} | only_a and a in only_a
    silent = compiler.lark('start: "a"+').start(stop_token_ids=[])  # llguidance's own EOS is not ours
    silent.consume(a)
    assert not silent.allowed()[1]


def test_validate_cuts_at_the_first_rejected_token_and_rollback_restores_the_state():
    matcher = byte_compiler(False).json_object().start([1])
    ids = encode_for(False, '{"a": [1, 2]}')
    bad = encode_for(False, "}")[0]  # after '{"a": ' a value must come
    assert matcher.validate_tokens(ids[:3] + [bad] + ids[3:]) == 3
    assert matcher.validate_tokens([1] + ids) == 0  # a stop token ends the count
    before = matcher.allowed()
    matcher.consume(ids[0])
    after_one = matcher.allowed()
    for token in ids[1:4]:
        matcher.consume(token)
    matcher.rollback(3)
    assert torch.equal(matcher.allowed(), after_one) and matcher.consumed == 1
    matcher.rollback(1)
    assert torch.equal(matcher.allowed(), before)
    with pytest.raises(GrammarError):
        matcher.rollback(1)


def test_mask_logits_sets_exactly_the_disallowed_tokens_to_minus_infinity():
    matcher = byte_compiler(False).json_schema(STATUS_SCHEMA).start([1])
    allowed = matcher.allowed()
    logits = torch.randn(ByteTokenizer.VOCAB + 8)  # a model vocabulary wider than the tokenizer's
    masked = matcher.mask_logits(logits)
    assert torch.equal(torch.isfinite(masked[:ByteTokenizer.VOCAB]), allowed)
    assert torch.equal(masked[:ByteTokenizer.VOCAB][allowed], logits[:ByteTokenizer.VOCAB][allowed])
    assert not torch.isfinite(masked[ByteTokenizer.VOCAB:]).any()
    assert torch.equal(matcher.mask_logits(logits.double()).float().isfinite(), masked.isfinite())


# ---------------------------------------------------------------- tool-call grammars

GOOD_CALLS = [("get_weather", {"city": "Paris"}),
              ("get_weather", {"city": "Ulm, DE", "unit": "celsius", "days": 3}),
              ("get_weather", {"city": "", "days": -2}),
              ("search", {"query": "a {b} [c]: d", "tags": ["x", "y"], "filter": {"min": 1.5, "sub": {"exact": True}}}),
              ("search", {"query": "q", "filter": {"sub": None}}),
              ("ping", {}), ("ping", {"anything": [1, "two"]})]
BAD_CALLS = [("get_weather", {"unit": "celsius"}),               # a required key missing
             ("get_weather", {"city": "Paris", "unit": "kelvin"}),  # outside the enum
             ("get_weather", {"city": "Paris", "days": 2.5}),       # not an integer
             ("get_weather", {"days": 3, "city": "Paris"}),          # not the declared order
             ("get_weather", {"city": "Paris", "wind": True}),       # an undeclared key
             ("search", {"query": "q", "filter": {"sub": 3}}),
             ("unknown_tool", {})]


@pytest.mark.parametrize("markers_as_tokens", [False, True], ids=["text-markers", "token-markers"])
def test_tool_call_grammar_accepts_what_the_chat_format_writes_and_parses(markers_as_tokens):
    compiler = byte_compiler(markers_as_tokens)
    constraint = compiler.tool_call(TOOLS)
    for name, args in GOOD_CALLS:
        text = call_text(name, args)
        ids = encode_for(markers_as_tokens, text)
        matcher = constraint.start([1])
        assert matcher.validate_tokens(ids) == len(ids), text
        for token in ids:
            matcher.consume(token)
        assert matcher.is_accepting(), text
        assert parse_generated(text).tool_calls == [{"name": name, "arguments": json.dumps(args)}]
    for name, args in BAD_CALLS:
        ids = encode_for(markers_as_tokens, call_text(name, args))
        assert constraint.start([1]).validate_tokens(ids) < len(ids), (name, args)
    two = encode_for(markers_as_tokens, call_text(*GOOD_CALLS[0]) + call_text(*GOOD_CALLS[5]))
    assert constraint.start([1]).validate_tokens(two) == len(two)
    named = compiler.tool_call(TOOLS, named="ping")  # exactly one call of that tool
    assert named.start([1]).validate_tokens(two) < len(two)
    one = encode_for(markers_as_tokens, call_text("ping", {}))
    matcher = named.start([1])
    for token in one:
        matcher.consume(token)
    assert matcher.is_stopped()


def test_tool_call_json_grammar_for_chat_templates():
    constraint = byte_compiler(False).tool_call_json(TOOLS, parallel=True, open_marker="<tool_call>\n",
                                                     close_marker="\n</tool_call>")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for text, ok in ((call, True), (call + "\n" + call, True),
                     ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False),
                     ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', False)):
        ids = encode_for(False, text)
        assert (constraint.start([1]).validate_tokens(ids) == len(ids)) == ok, text
    # a special token inside a marker is matched as that token, the rest of the marker as text
    as_token = byte_compiler(True).tool_call_json(TOOLS, named="ping", open_marker=CALL_OPEN + "\n")
    text = CALL_OPEN + '\n{"name": "ping", "arguments": {}}'
    assert as_token.start([1]).validate_tokens(encode_for(True, text)) == len(encode_for(True, text))
    assert as_token.start([1]).validate_tokens(encode_for(False, text)) == 0  # the marker spelled as text


def test_a_token_quoted_string_cannot_spell_the_quote_as_text():
    """With the quote a special token, the text between two quotes must not contain the quote's
    text either: common.chat_format's parser, reading decoded text, would end the string there."""
    constraint = byte_compiler(True).tool_call(TOOLS, named="search")
    head = encode_for(True, f"{CALL_OPEN}call:search{{query:{QUOTE}ab")
    spelled = encode_for(False, QUOTE)  # the quote's characters as plain bytes
    assert constraint.start([1]).validate_tokens(head + spelled) < len(head + spelled)
    assert constraint.start([1]).validate_tokens(head + spelled[:-1]) == len(head + spelled) - 1


def test_what_cannot_be_constrained_is_refused():
    compiler = byte_compiler(False)
    with pytest.raises(ValueError):
        compiler.json_schema({"type": "string", "format": "no-such-format"})
    with pytest.raises(ValueError):
        compiler.lark("start: undefined_rule")
    for tools, named in (([], None), (TOOLS, "missing"),
                         ([{"type": "function", "function": {"name": "two words"}}], None),
                         ([{"type": "function", "function": {"name": "f", "parameters": {
                             "type": "object", "properties": {"a:b": {"type": "string"}}}}}], None)):
        with pytest.raises(ValueError):
            compiler.tool_call(tools, named=named)


@pytest.mark.parametrize("markers_as_tokens", [False, True], ids=["text-markers", "token-markers"])
def test_optional_calls_grammar_takes_text_then_checked_calls_or_none(markers_as_tokens):
    """tool_choice "auto" with strict tools: free text, then none, one (parallel=False) or more calls,
    each checked as a required call is; nothing after the calls, and the text never spells the call
    opener (the parser would read a call the grammar did not check)."""
    compiler = byte_compiler(markers_as_tokens)
    many, one = compiler.tool_call(STRICT_TOOLS, optional=True), compiler.tool_call(STRICT_TOOLS, parallel=False,
                                                                                  optional=True)
    call, other = call_text(*GOOD_CALLS[0]), call_text(*GOOD_CALLS[5])

    def takes(constraint, text: str) -> bool:
        ids = encode_for(markers_as_tokens, text)
        matcher = constraint.start([1])
        if matcher.validate_tokens(ids) < len(ids):
            return False
        for token in ids:
            matcher.consume(token)
        return matcher.is_accepting()

    for text in ("", "Plain text, no call.", call, "Let me look. " + call, "x" + call + other):
        assert takes(many, text), text
        assert parse_generated(text).content == (text.split(CALL_OPEN)[0] if CALL_OPEN in text else text)
    assert takes(one, "Let me look. " + call) and not takes(one, call + other)
    for name, args in BAD_CALLS:
        assert not takes(many, "hi " + call_text(name, args)), (name, args)
    assert not takes(many, call + "text after the calls")
    # only the strict tools' arguments are checked: a tool not marked strict takes any object
    loose = compiler.tool_call([STRICT_TOOLS[0], *TOOLS[1:]], optional=True)
    assert takes(loose, call_text("search", {"anything": 1})) and not takes(many, call_text("search", {"anything": 1}))
    if markers_as_tokens:  # the opener spelled as text, not the token: refused
        assert not takes(many, "hi " + BYTE_TOKENIZER.decode(BYTE_TOKENIZER.encode_bytes(CALL_OPEN.encode())))


def test_numbers_in_calls_are_bounded():
    """A call's numbers take at most 20 digits before and after the point (a small model once wrote
    digits until max_tokens); 64-bit integers and doubles fit."""
    constraint = byte_compiler(True).tool_call(TOOLS, named="get_weather")
    for days, ok in ((2**63 - 1, True), (-(10**19), True), (10**20, False), (10**25, False)):
        ids = encode_for(True, call_text("get_weather", {"city": "Ulm", "days": days}))
        assert (constraint.start([1]).validate_tokens(ids) == len(ids)) == ok, days


def test_strict_tools_refuse_what_the_grammar_cannot_enforce():
    from server.tool_grammars import unenforced_keywords

    assert unenforced_keywords(STRICT_OK) == []
    assert unenforced_keywords({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}},
                                "$defs": {"d": {"type": "integer", "minimum": 0}}}) == ["minimum", "pattern"]
    assert unenforced_keywords({"type": "object", "properties": {"a": {"type": "string"}},
                                "additionalProperties": True}) == ["additionalProperties"]
    assert unenforced_keywords(NO_ARGUMENTS) == []
    assert unenforced_keywords({"type": "array", "items": {"type": "string"}, "minItems": 2}) == ["minItems"]
    assert unenforced_keywords({"type": "array", "items": [{"type": "string"}]}) == ["items"]  # a tuple
    assert unenforced_keywords({"oneOf": [{"type": "string"}], "allOf": [{}]}) == ["allOf", "oneOf"]
    assert unenforced_keywords({"anyOf": [{"type": "string"}], "type": "integer"}) == ["anyOf"]
    assert unenforced_keywords({"$ref": "#/$defs/x", "description": "an annotation"}) == []
    # a strict tool of no arguments (the Agents SDK's schema): "{}" and nothing else
    constraint = byte_compiler(True).tool_call(_tool(NO_ARGUMENTS))
    for args, ok in (({}, True), ({"a": 1}, False)):
        ids = encode_for(True, call_text("f", args))
        assert (constraint.start([1]).validate_tokens(ids) == len(ids)) == ok, args


STRICT_TOOLS = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
NO_ARGUMENTS = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
# what the OpenAI Agents SDK sends for a function of one string argument (strict by default)
STRICT_OK = {"type": "object", "properties": {"order_id": {"title": "Order Id", "type": "string"}},
             "required": ["order_id"], "title": "get_order_status_args", "additionalProperties": False}


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


SELF_REFERENCE = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
MALFORMED_PARAMETERS = [  # a client's schema with a keyword of the wrong type (each gave a 500 once)
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
    {"type": "object", "properties": [1]},
    {"type": "object", "properties": {"a": {"type": "array", "minItems": "x"}}},
    {"type": "object", "properties": {"a": {"enum": 5}}},
    {"type": "object", "properties": {"a": {"anyOf": 5}}},
    {"type": "object", "properties": {"a": {"$ref": 5}}},
    {"type": "object", "properties": {"a": {"$ref": [1]}}},
    {"type": "object", "allOf": [{"properties": 5}]},
    {"type": "object", "properties": {"a": {"type": 5}}},
    # no value satisfies these: refused, not compiled into a grammar that ends calls at "{"
    {"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]},
    SELF_REFERENCE,
    {"type": "object", "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}},
     "properties": {"a": {"$ref": "#/$defs/x"}}},
    # cycles through a wrapper, and a required property that is the object itself: never complete
    {"type": "object", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "properties": {"x": {"$ref": "#/$defs/a"}},
     "required": ["x"]},
    {"type": "object", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "properties": {"x": {"$ref": "#/$defs/a"}},
     "required": ["x"]},
    {"type": "object", "$defs": {"n": {"type": "object", "properties": {"child": {"$ref": "#/$defs/n"}},
                                       "required": ["child"]}},
     "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"]},
]


@pytest.mark.parametrize("parameters", MALFORMED_PARAMETERS)
@pytest.mark.parametrize("markers_as_tokens", [False, True], ids=["text-markers", "token-markers"])
def test_malformed_or_unsatisfiable_tool_schemas_are_refused(parameters, markers_as_tokens):
    compiler = byte_compiler(markers_as_tokens)
    with pytest.raises(ValueError):
        compiler.tool_call(_tool(parameters))


def test_a_self_referencing_schema_is_refused_and_a_recursive_one_is_not():
    compiler = byte_compiler(False)
    for schema in (SELF_REFERENCE, *MALFORMED_PARAMETERS[-3:]):
        with pytest.raises(ValueError, match="no finite value satisfies"):
            compiler.json_schema(schema)
        with pytest.raises(ValueError, match="no finite value satisfies"):
            compiler.tool_call_json(_tool(schema))
    tuple_items = {"type": "object", "properties": {"pair": {"type": "array", "items": [{"type": "string"}]}}}
    compiler.tool_call(_tool(tuple_items))  # a tuple's items (draft 7): any value, as before
    tree = {"$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}},
            "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}}
    compiler.json_schema(tree)
    compiler.tool_call(_tool(tree))
    compiler.tool_call_json(_tool(tree))


# ---------------------------------------------------------------- the engine, tiny Gemma 4

@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma4()


class InvalidThenValid:
    """The true continuation with `bad` grammar-rejected tokens appended (cut before verification)."""

    def __init__(self, prompt_len: int, reference: list[int], bad: list[int]):
        self.prompt_len, self.reference, self.bad = prompt_len, reference, bad
        self.sessions = []

    def session(self):
        def propose(context, max_tokens):
            pos = len(context) - self.prompt_len
            good = self.reference[pos:pos + max(0, max_tokens - len(self.bad))]
            tokens = (good + self.bad)[:max_tokens]
            return Draft(np.asarray(tokens, dtype=np.int32), np.ones(len(tokens), dtype=np.float32), "test", 0)
        self.sessions.append(_Session(propose))
        return self.sessions[-1]


def generate(engine, prompt, constraint, **sampling):
    from server.engine import GenerationParams
    from server.sampling import SamplingParams

    draft = sampling.pop("draft", True)
    max_tokens = sampling.pop("max_tokens", 48)
    tokens, text, finish, stats = [], "", None, None
    for chunk in engine.generate(prompt, GenerationParams(max_tokens=max_tokens, draft=draft, constraint=constraint,
                                                          sampling=SamplingParams(**sampling))):
        tokens += chunk.token_ids
        text += chunk.text
        finish, stats = chunk.finish_reason, chunk.stats
    return tokens, text, finish, stats


SAMPLED = [dict(), dict(temperature=1.0, seed=7), dict(temperature=0.8, top_p=0.9, top_k=40, seed=3),
           dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, seed=11)]


@tiny_test
def test_tiny_constrained_outputs_follow_the_grammar_and_finish_with_stop(tiny):
    status = byte_compiler(False).json_schema(STATUS_SCHEMA)
    switch = byte_compiler(True).tool_call(SWITCH_TOOLS, parallel=False)
    engine = engine_for(tiny, BYTE_TOKENIZER)
    for i, prompt in enumerate(prompts_for(512, (5, 9, 30))):
        for sampling in SAMPLED:
            tokens, text, finish, stats = generate(engine, prompt, status, draft=False, max_tokens=80, **sampling)
            assert finish == "stop", (i, sampling, text)
            check_status(json.loads(text))
            tokens, text, finish, _ = generate(engine, prompt, switch, draft=False, max_tokens=80, **sampling)
            calls = parse_generated(BYTE_TOKENIZER.decode(tokens)).tool_calls
            assert finish == "stop" and len(calls) == 1 and calls[0]["name"] in ("lamp", "fan"), text
            assert isinstance(json.loads(calls[0]["arguments"])["on"], bool)


@tiny_test
def test_tiny_constrained_drafted_equals_plain(tiny):
    constraints = {"json_object": byte_compiler(False).json_object(),
                   "tool_call": byte_compiler(True).tool_call(TOOLS),
                   # tool_choice "auto" with strict tools: free text, then calls or none
                   "optional_calls": byte_compiler(True).tool_call(STRICT_TOOLS, optional=True),
                   "optional_call_text_markers": byte_compiler(False).tool_call(STRICT_TOOLS, parallel=False,
                                                                                optional=True)}
    plain_engine = engine_for(tiny, BYTE_TOKENIZER)
    cut = accepted = 0
    for i, prompt in enumerate(prompts_for(512, (6, 40))):
        for name, constraint in constraints.items():
            for sampling in SAMPLED[:3]:
                plain, plain_text, finish, _ = generate(plain_engine, prompt, constraint, draft=False, **sampling)
                prefix = constraint.start([1])
                assert prefix.validate_tokens(plain) == len(plain)  # the output is in the grammar
                for drafter in (OracleWithErrors(len(prompt), plain, 512, 0.3, seed=i), RandomDrafter(512, seed=i)):
                    engine = engine_for(tiny, BYTE_TOKENIZER, drafter=drafter)
                    got, text, got_finish, stats = generate(engine, prompt, constraint, **sampling)
                    assert got == plain, (name, sampling, type(drafter).__name__)
                    assert text == plain_text and got_finish == finish
                    cut += stats.grammar_cut_tokens
                    accepted += stats.accepted_tokens
    assert cut > 0 and accepted > 0  # drafts were cut, and drafts were taken


def test_constrained_requests_at_once_on_the_int8_path_equal_plain_alone():
    """The CPU int8 path, four requests at once (their prefills, past the window of 8, and drafted
    steps sharing forwards), each under a grammar (a JSON object or a tool call), greedy and seeded:
    each output equals its plain constrained output served alone; the grammar cut drafts, and drafts
    were taken."""
    from server.cpu_backend import CpuBackend
    from server.cpu_model import CpuGemma
    from tests.test_batching import _concurrently, _PerRequestDrafter
    from tests.test_cpu_model import tiny_gemma3
    from tests.test_engine_lossless import run

    model = tiny_gemma3(seed=4)
    cpu = CpuGemma.from_hf(model)
    alone = engine_for(model, BYTE_TOKENIZER, backend=CpuBackend(cpu, 4096, 0, max_step=17), parallel=1)
    constraints = [byte_compiler(False).json_object(), byte_compiler(True).tool_call(TOOLS)] * 2
    prompts = prompts_for(512, (40, 70, 25, 90), seed=12)
    params = [dict(constraint=c, max_tokens=48, **SAMPLED[i]) for i, c in enumerate(constraints)]
    want = [run(alone, p, draft=False, **kw) for p, kw in zip(prompts, params)]
    engine = engine_for(model, BYTE_TOKENIZER, backend=CpuBackend(cpu, 4096, 0, max_step=17), parallel=4)
    engine.set_drafter(_PerRequestDrafter({tuple(p): OracleWithErrors(len(p), w[0], 512, 0.3, seed=i)
                                           for i, (p, w) in enumerate(zip(prompts, want))}))
    got = _concurrently(engine, list(zip(prompts, params)))
    for i, ((tokens, text, finish, stats), (plain, plain_text, plain_finish, _)) in enumerate(zip(got, want)):
        assert (tokens, text, finish) == (plain, plain_text, plain_finish), i
    assert sum(s.grammar_cut_tokens for *_, s in got) > 0 and sum(s.accepted_tokens for *_, s in got) > 0
    assert engine.batch_summary()["peak_sequences"] > 1


@tiny_test
def test_tiny_grammar_rejected_draft_tokens_are_never_verified(tiny):
    constraint = byte_compiler(True).tool_call(TOOLS)
    prompt = prompts_for(512, [12])[0]
    plain, *_ = generate(engine_for(tiny, BYTE_TOKENIZER), prompt, constraint, draft=False)
    rejected = [0, 0, 2]  # <pad>, <bos>: never in a tool call
    only_bad = InvalidThenValid(len(prompt), [], rejected)
    got, _, _, stats = generate(engine_for(tiny, BYTE_TOKENIZER, drafter=only_bad), prompt, constraint)
    assert got == plain and stats.grammar_cut_tokens > 0
    assert stats.drafts == stats.verify_steps == stats.drafted_tokens == 0
    valid_then_bad = InvalidThenValid(len(prompt), plain, rejected)
    got, _, _, stats = generate(engine_for(tiny, BYTE_TOKENIZER, drafter=valid_then_bad), prompt, constraint)
    assert got == plain and stats.verify_steps > 0 and stats.grammar_cut_tokens > 0
    fed = valid_then_bad.sessions[-1].fed
    assert fed and all(drafted == accepted for drafted, accepted in fed)  # only the true, valid part was verified


# ---------------------------------------------------------------- the bundled 270M, its tokenizer

PERSON_SCHEMA = {"type": "object",
                 "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                "city": {"type": "string", "maxLength": 40}},
                 "required": ["name", "age", "city"], "additionalProperties": False}
PERSON_PROMPTS = ["Alice is 30 years old and lives in Paris.\nThe same facts as JSON: ",
                  "Bob, 45, from Berlin.\nJSON: ",
                  "Write a JSON record for a fictional person.\n"]
WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}}]


@pytest.fixture(scope="module")
def gemma_compiler(gemma270m):
    return GrammarCompiler.for_tokenizer(gemma270m.tokenizer, gemma270m.model.config.vocab_size)


def _check_person(obj) -> None:
    """PERSON_SCHEMA, checked by hand."""
    assert isinstance(obj, dict) and list(obj) == ["name", "age", "city"], obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 40 and isinstance(obj["city"], str)
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool)


def _tool_prompt(tokenizer, question: str) -> list[int]:
    text = ChatFormat.for_tokenizer(tokenizer).render_prompt([{"role": "user", "content": question}], WEATHER_TOOLS)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # measured 3x faster than two threads on a shared 2-core machine
def test_270m_json_outputs_parse_and_validate(gemma270m, gemma_compiler):
    from server.engine import Engine, EngineConfig

    tok = gemma270m.tokenizer
    engine = Engine(gemma270m, None, EngineConfig(adaptive=False))
    person = gemma_compiler.json_schema(PERSON_SCHEMA)
    for i, text in enumerate(PERSON_PROMPTS):
        for sampling in (dict(), dict(temperature=0.8, seed=i)):
            _, out, finish, _ = generate(engine, tok(text)["input_ids"], person, draft=False, max_tokens=64, **sampling)
            assert finish == "stop", out
            _check_person(json.loads(out))
    _, out, finish, _ = generate(engine, tok(PERSON_PROMPTS[0])["input_ids"], gemma_compiler.json_object(), draft=False,
                                 max_tokens=64)
    assert finish == "stop" and isinstance(json.loads(out), dict), out


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # measured 3x faster than two threads on a shared 2-core machine
def test_270m_tool_call_in_the_builtin_format_parses(gemma270m, gemma_compiler):
    from server.engine import Engine, EngineConfig

    engine = Engine(gemma270m, None, EngineConfig(adaptive=False))
    prompt = _tool_prompt(gemma270m.tokenizer, "What's the weather in Tokyo?")
    for named, expected in ((None, {"get_weather", "search_web"}), ("search_web", {"search_web"})):
        constraint = gemma_compiler.tool_call(WEATHER_TOOLS, named=named, parallel=False)
        _, out, finish, _ = generate(engine, prompt, constraint, draft=False, max_tokens=64)
        calls = parse_generated(out).tool_calls
        assert finish == "stop" and len(calls) == 1 and calls[0]["name"] in expected, out
        required = "city" if calls[0]["name"] == "get_weather" else "query"
        assert isinstance(json.loads(calls[0]["arguments"])[required], str)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # measured 3x faster than two threads on a shared 2-core machine
def test_270m_constrained_drafted_equals_plain(gemma270m, gemma_compiler):
    from server.engine import Engine, EngineConfig

    tok = gemma270m.tokenizer
    vocab = gemma270m.model.config.vocab_size
    cases = [(gemma_compiler.json_schema(PERSON_SCHEMA), tok(PERSON_PROMPTS[1])["input_ids"]),
             (gemma_compiler.tool_call(WEATHER_TOOLS), _tool_prompt(tok, "Find news about Mars."))]
    engine = Engine(gemma270m, None, EngineConfig(adaptive=False))
    totals = dict(cut=0, accepted=0)
    for i, (constraint, prompt) in enumerate(cases):
        for sampling in (dict(), dict(temperature=1.0, top_k=64, top_p=0.95, seed=5 + i)):
            engine.set_drafter(None)
            plain, *_ = generate(engine, prompt, constraint, draft=False, max_tokens=32, **sampling)
            for drafter in (OracleWithErrors(len(prompt), plain, vocab, 0.3, seed=i), RandomDrafter(vocab, seed=i)):
                engine.set_drafter(drafter)
                got, _, _, stats = generate(engine, prompt, constraint, max_tokens=32, **sampling)
                assert got == plain, (i, sampling, type(drafter).__name__)
                totals["cut"] += stats.grammar_cut_tokens
                totals["accepted"] += stats.accepted_tokens
    only_bad = InvalidThenValid(len(cases[0][1]), [], [0, 2, 106])  # <pad>, <bos>, <start_of_turn>
    engine.set_drafter(only_bad)
    got, _, _, stats = generate(engine, cases[0][1], cases[0][0], max_tokens=32)
    assert stats.verify_steps == stats.drafted_tokens == 0 and stats.grammar_cut_tokens > 0
    assert totals["cut"] > 0 and totals["accepted"] > 0, totals
