"""common.prompt_tokens: a prompt tokenized from an earlier prompt's tokens is the prompt tokenized
whole, token for token, and a growing conversation is tokenized only at its tail.

On the bundled model's tokenizer (Gemma's: special turn tokens, newline runs as added tokens,
byte fallback). Random texts built from the pieces that make cuts hard (special tokens whole and
cut in half, newline runs, spaces, multi-byte characters) are edited at random places and encoded
after their originals; the same check with the rule's margin removed finds mismatches, so the
check can tell a wrong cut from a right one.
"""
from __future__ import annotations

import random

import pytest

from common.chat_format import ChatFormat
from common.prompt_tokens import PromptTokens, shared_prefix
from common.tokenizer import load_tokenizer
from server.protocol import parse_messages, parse_tools

PIECES = ["hello", " world", "\n", "\n\n", "\n\n\n", "<start_of_turn>", "<end_of_turn>", "<bos>", " ", "  ",
          "é", "🙂", '{"a": 1}', "tool", "_call", "\t", "<start_of_", "turn>", "<end_", "xxxxx", "model\n", "user\n"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _whole(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def _edit(rng: random.Random, text: str, tok=None, added: frozenset = frozenset()) -> str:
    """`text` with a random insertion, the rest after it kept or dropped: at a random place, or (with
    `tok` and its `added` token ids, half the time) near where an added token starts: at it, inside it, just past it, or about
    the longest added token's length after it, a few characters either way."""
    at = rng.randint(0, len(text))
    if tok is not None and text and rng.random() < 0.5:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [(a, b) for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if t in added]
        if starts:
            a, b = rng.choice(starts)
            at = min(len(text), max(0, rng.choice([a, b, a + 31, a + 16]) + rng.randint(-3, 3)))
    tail = text[at + rng.randint(0, 6):] if rng.random() < 0.5 else ""
    return text[:at] + _random_text(rng, rng.randint(0, 8)) + tail


def _mismatches(tok, prompt_tokens: PromptTokens, rounds: int, seed: int) -> int:
    rng = random.Random(seed)
    added = frozenset(tok.added_tokens_decoder)
    bad = 0
    for _ in range(rounds):
        text = _random_text(rng, rng.randint(0, 40))
        bad += prompt_tokens.encode(text) != _whole(tok, text)
        for _ in range(3):  # a chain of edits, each encoded after the one before (several prompts kept)
            text = _edit(rng, text, tok, added)
            bad += prompt_tokens.encode(text) != _whole(tok, text)
    return bad


def test_edited_texts_tokenize_as_whole(tok):
    prompt_tokens = PromptTokens(tok, max_kept=8)
    assert prompt_tokens.reuses
    assert _mismatches(tok, prompt_tokens, 1500, seed=0) == 0
    s = prompt_tokens.summary()
    assert s["reused_tokens"] > 0 and s["prompts"] == 1500 * 4


def test_the_check_finds_a_cut_the_margin_would_refuse(tok):
    """With the margin dropped (a cut taken as soon as the shared prefix reaches its start), a
    special token that the edit changes right after the cut makes wrong ids: the check sees it."""
    prompt_tokens = PromptTokens(tok, max_kept=8)
    prompt_tokens.margin = 0
    assert _mismatches(tok, prompt_tokens, 500, seed=1) > 0


def _conversation(turns: int) -> list[dict]:
    text = open(__file__).read()
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(turns):
        messages.append({"role": "user", "content": text[i * 700:(i + 1) * 700]})
        messages.append({"role": "assistant", "content": f"Reply {i}: " + text[i * 300:(i + 1) * 300]})
    return messages


def test_a_growing_conversation_is_tokenized_at_its_tail(tok):
    fmt = ChatFormat.for_tokenizer(tok)
    prompt_tokens = PromptTokens(tok)
    tools = parse_tools([{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                           "parameters": {"type": "object", "properties": {
                                                               "path": {"type": "string"}}}}}])
    last = None
    for turns in range(1, 9):
        messages = _conversation(turns)
        text = fmt.render_prompt(parse_messages(messages[:-1]), tools, "auto")  # ends with the last user turn
        before = prompt_tokens.summary()
        ids = prompt_tokens.encode(text)
        assert ids == _whole(tok, text)
        encoded = prompt_tokens.summary()["encoded_tokens"] - before["encoded_tokens"]
        if last is not None:  # the turn's new messages (about 330 tokens) and a few before them, no more
            assert encoded <= len(ids) - last + 40, (encoded, len(ids), last)
        last = len(ids)
    # the earlier turns' prompts were dropped as their successors continued them
    assert prompt_tokens.summary()["kept"] == 1


def test_limits_and_a_prompt_that_shares_nothing(tok):
    prompt_tokens = PromptTokens(tok, max_chars=300, max_kept=2)
    texts = ["<start_of_turn>user\nalpha<end_of_turn>\n", "<start_of_turn>user\nbeta<end_of_turn>\n",
             "<bos>gamma<end_of_turn>\n"]
    for text in texts:
        assert prompt_tokens.encode(text) == _whole(tok, text)
    assert prompt_tokens.summary()["kept"] == 2  # max_kept: the oldest went
    long_text = "<start_of_turn>user\n" + "word " * 100
    assert prompt_tokens.encode(long_text) == _whole(tok, long_text)
    s = prompt_tokens.summary()
    assert s["kept_chars"] <= 300 and s["kept"] <= 2  # over max_chars: not kept, nothing else pushed out
    assert prompt_tokens.encode("") == _whole(tok, "") == []
    assert prompt_tokens.encode("no special token at all") == _whole(tok, "no special token at all")


def test_resends_branches_and_texts_without_cuts_keep_the_right_prompts(tok):
    """A prompt sent again as it was is answered from its kept ids, not kept twice; a prompt no
    text could continue (no cut a margin before its end) is not kept, so it pushes nothing out; a
    branch (an edit before the kept prompt's last cuts) keeps both."""
    prompt_tokens = PromptTokens(tok, max_kept=4)
    convo = "<start_of_turn>user\n" + "question line\n" * 50 + "<end_of_turn>\n<start_of_turn>model\n"
    assert prompt_tokens.encode(convo) == _whole(tok, convo)
    for _ in range(10):
        assert prompt_tokens.encode(convo) == _whole(tok, convo)
    s = prompt_tokens.summary()
    assert s["kept"] == 1 and s["reused_tokens"] == 10 * len(_whole(tok, convo))
    for i in range(6):  # no cut at all, or none a margin before the end: never kept
        for text in (f"plain text {i} " * 30, f"{'word ' * 40}\n{i}"):
            assert prompt_tokens.encode(text) == _whole(tok, text)
    assert prompt_tokens.summary()["kept"] == 1
    branch = convo[: len(convo) // 2] + "an edited line\n" * 10
    assert prompt_tokens.encode(branch) == _whole(tok, branch)
    assert prompt_tokens.summary()["kept"] == 2  # the original's later cuts are still worth keeping
    before = prompt_tokens.summary()["encoded_tokens"]
    nxt = convo + "Sure.<end_of_turn>\n"
    assert prompt_tokens.encode(nxt) == _whole(tok, nxt)
    assert prompt_tokens.summary()["encoded_tokens"] - before < 20  # continued from the original
    assert prompt_tokens.summary()["kept"] == 2  # which it now serves in its place


@pytest.mark.parametrize("a, b, n", [("", "", 0), ("abc", "abd", 2), ("abc", "abc", 3), ("ab", "abc", 2),
                                     ("x" * 10000, "x" * 9000 + "y", 9000), ("x" * 8192, "x" * 8192, 8192)])
def test_shared_prefix(a, b, n):
    assert shared_prefix(a, b) == shared_prefix(b, a) == n


def test_the_bench_measures_both_ways_on_the_same_ids(tok):
    """bench.prompt_tokens on a short rendered conversation: each turn tokenized both ways, equal."""
    from bench.prompt_tokens import measure

    fmt = ChatFormat.for_tokenizer(tok)
    messages = _conversation(4)
    prompts = [fmt.render_prompt(parse_messages(messages[:i]), [], "auto") for i in (2, 4, 6, 8)]
    r = measure(prompts, rounds=2, tok=tok)
    assert r["turns"] == 4 and r["identical_turns"] == 4
    assert r["last_tokens"] == len(_whole(tok, prompts[-1])) and r["session_ms_whole"] > 0 < r["session_ms_reused"]
