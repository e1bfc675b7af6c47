"""server/tool_schema.py: a tool call's opening and parameter names drafted from the request's own
declarations, with the bundled model's tokenizer and prompts rendered by common.chat_format; and
drafted output still equal to plain output through the engine on the bundled model."""
from __future__ import annotations

import numpy as np
import pytest

from common.chat_format import ChatFormat
from common.tokenizer import load_tokenizer
from ngram.draft import EMPTY_DRAFT, Draft
from ngram.drafter import DrafterConfig, NgramDrafter
from server.tool_schema import ToolSchemaDrafter, make_drafter, parse_declarations

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "calculate_triangle_area", "description": "Area of a triangle.",
     "parameters": {"type": "object", "properties": {"base": {"type": "integer", "description": "{odd: text}"},
                                                     "height": {"type": "integer"}},
                    "required": ["base", "height"]}}},
    {"type": "function", "function": {"name": "list_all_airports", "description": "Every airport.",
     "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


class Fixed:
    """An inner drafter whose every proposal is `tokens` (the wrapper's decisions, isolated)."""

    def __init__(self, tokens=()):
        self.tokens, self.overlay, self.config = list(tokens), None, DrafterConfig()

    def session(self):
        return self

    def prepare(self, ids):
        pass

    def propose(self, ids, max_tokens):
        return Draft(self.tokens[:max_tokens], [0.5] * len(self.tokens[:max_tokens]), "index", 3) if self.tokens else EMPTY_DRAFT

    def feedback(self, drafted, accepted):
        pass

    def finish(self, ids=None):
        pass


def prompt(tok, user: str) -> list[int]:
    text = ChatFormat.for_tokenizer(tok).render_prompt([{"role": "user", "content": user}], TOOLS)
    return tok(text, add_special_tokens=False)["input_ids"]


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_declarations_are_parsed_in_order(tok):
    text = ChatFormat.for_tokenizer(tok).render_prompt([{"role": "user", "content": "hi"}], TOOLS)
    assert parse_declarations(text) == {"get_weather": ["city", "unit"], "calculate_triangle_area": ["base", "height"],
                                        "list_all_airports": []}


def test_the_opening_of_the_function_the_user_asks_for(tok):
    ids = prompt(tok, "What is the area of a triangle with base 10 and height 5?")
    session = ToolSchemaDrafter(Fixed(), tok).session()
    session.prepare(ids)
    draft = session.propose(np.asarray(ids), 32)
    assert draft.source == "schema"
    assert tok.decode(draft.tokens) == "<|tool_call>call:calculate_triangle_area{base:"
    # from where the tokens stand: after part of the name, the rest of it
    head = enc(tok, "<|tool_call>call:calculate_triangle_area{base:")[:len(enc(tok, "<|tool_call>call:")) + 1]
    draft = session.propose(np.asarray(ids + head), 32)
    assert tok.decode(head + list(draft.tokens)) == "<|tool_call>call:calculate_triangle_area{base:"


def test_the_next_parameter_after_a_comma(tok):
    ids = prompt(tok, "What is the area of a triangle with base 10 and height 5?")
    session = ToolSchemaDrafter(Fixed(), tok).session()
    session.prepare(ids)
    call = enc(tok, "<|tool_call>call:calculate_triangle_area{base:10,")
    draft = session.propose(np.asarray(ids + call), 32)
    assert draft.source == "schema" and tok.decode(call + list(draft.tokens)).endswith("{base:10,height:")
    done = enc(tok, "<|tool_call>call:calculate_triangle_area{base:10,height:5,")
    assert session.propose(np.asarray(ids + done), 32) is EMPTY_DRAFT  # no parameter left: the inner draft


def test_an_inner_draft_naming_a_declared_function_stands(tok):
    ids = prompt(tok, "What is the area of a triangle with base 10 and height 5?")
    weather = enc(tok, "<|tool_call>call:get_weather{city:")
    session = ToolSchemaDrafter(Fixed(weather), tok).session()
    session.prepare(ids)
    assert list(session.propose(np.asarray(ids), 32).tokens) == weather  # declared: the drafter's guess stands
    other = enc(tok, "<|tool_call>call:send_email{to:")
    session = ToolSchemaDrafter(Fixed(other), tok).session()
    session.prepare(ids)
    assert session.propose(np.asarray(ids), 32).source == "schema"     # undeclared: replaced


def test_a_function_without_parameters_stops_at_its_name(tok):
    ids = prompt(tok, "List all airports please")
    session = ToolSchemaDrafter(Fixed(), tok).session()
    session.prepare(ids)
    # the tokenizer may merge "{" with what follows ("{}"): the opening ends at the name
    assert tok.decode(session.propose(np.asarray(ids), 32).tokens) == "<|tool_call>call:list_all_airports"


def test_no_declarations_no_change(tok):
    text = ChatFormat.for_tokenizer(tok).render_prompt([{"role": "user", "content": "Tell me a story"}], [])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    inner = Fixed(enc(tok, "Once upon"))
    session = ToolSchemaDrafter(inner, tok).session()
    session.prepare(ids)
    assert list(session.propose(np.asarray(ids), 8).tokens) == inner.tokens


def test_a_later_turn_reads_only_what_is_new(tok):
    """The next turn of a conversation extends the prompt: the drafter decodes only spans past what
    it read before, and finds what a fresh one finds (functions, parameters, the last user turn)."""
    first = np.asarray(prompt(tok, "Weather in Paris?"))
    more = enc(tok, "It is sunny." * 40 + "<turn|>\n<|turn>user\nAnd the area of a triangle, base 3 height 4?"
                    "<turn|>\n<|turn>model\n")
    later = np.concatenate([first, np.asarray(more)])
    warm, fresh = ToolSchemaDrafter(Fixed(), tok), ToolSchemaDrafter(Fixed(), tok)
    warm.declarations(first)
    expected = fresh.declarations(later)
    decoded = []
    decode = warm.vocab.decode  # (the vocabulary is shared by drafters of one tokenizer)
    warm.vocab.decode = lambda ids: decoded.append(len(ids)) or decode(ids)
    try:
        assert warm.declarations(later) == expected
    finally:
        warm.vocab.decode = decode
    # only the last declaration's span, which reached the prompt's end, is read again
    assert len(decoded) == 1
    session = warm.session()
    session.prepare(later)
    assert tok.decode(session.propose(later, 32).tokens) == "<|tool_call>call:calculate_triangle_area{base:"


def test_make_drafter_follows_the_setting(tok):
    assert isinstance(make_drafter(None, DrafterConfig(), tok), ToolSchemaDrafter)
    assert isinstance(make_drafter(None, DrafterConfig(tool_schema=False), tok), NgramDrafter)
    assert isinstance(make_drafter(None, DrafterConfig(), None), NgramDrafter)
    assert isinstance(make_drafter(None, DrafterConfig(), object()), NgramDrafter)  # not a usable tokenizer
    wrapped = make_drafter(None, DrafterConfig(max_draft=9), tok)
    assert wrapped.index is None and wrapped.config.max_draft == 9  # the inner drafter's, seen through


@pytest.mark.slow
def test_270m_drafted_with_the_tool_schema_equals_plain():
    """Through the engine on the bundled model: tool-call prompts, greedy, the schema drafter on
    (real index-free n-gram drafter inside) against plain decoding, token for token."""
    from server.engine import Engine, EngineConfig, GenerationParams
    from server.model_loading import load_target

    target = load_target(None)
    tok = target.tokenizer
    drafter = make_drafter(None, DrafterConfig(), tok)
    plain_engine = Engine(target, None, EngineConfig())
    drafted_engine = Engine(target, drafter, EngineConfig())
    for user in ("What is the area of a triangle with base 10 and height 5?", "Weather in Paris, in celsius?",
                 "List all airports please"):
        ids = prompt(tok, user)
        params = GenerationParams(max_tokens=32)
        plain = [t for c in plain_engine.generate(ids, params) for t in c.token_ids]
        drafted = [t for c in drafted_engine.generate(ids, params) for t in c.token_ids]
        assert drafted == plain, (user, tok.decode(plain), tok.decode(drafted))
