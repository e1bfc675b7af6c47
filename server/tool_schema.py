"""Drafting a tool call's opening from the request's own tool declarations.

Contract: `ToolSchemaDrafter(inner, tokenizer)` is a Drafter (ngram.draft's protocol) whose sessions
wrap `inner`'s (an NgramDrafter). `prepare(prompt)` reads the prompt's tool declarations, as
common.chat_format renders them (`<|tool>declaration:NAME{...,parameters:{...,properties:{P:{...},
...}}}<tool|>`), into each function's name and parameter names in declaration order, and the words
of the last user message. Then, in the model's turn, `propose` returns the inner draft except:
- while the tokens since the last `<|tool_call>` (or, before any, since the turn began) are a
  proper prefix of a declared call's opening `<|tool_call>call:NAME{P1:` (P1 its first parameter;
  `<|tool_call>call:NAME` for a function without parameters) and the inner draft does not name a
  declared function: the opening of the declared function whose name shares the most words with
  the last user message (the first declared on a tie), from where the tokens stand;
- right after a `,` inside a call of a declared function, when the inner draft does not start
  with one of its unused parameters: the next unused parameter in declaration order and its `:`.
Any draft is verified by the target, so output is unchanged; `make_drafter(index, config,
tokenizer)` is how the server and the benchmarks build the drafter (wrapped unless
`DrafterConfig.tool_schema` is off or the tokenizer is unknown).

Why: an n-gram drafter has only seen *other* functions' names after `call:`: on a request whose
functions are new (most of BFCL's single-turn and live questions) its draft of the name is wrong
from the first token, and so are its parameter names. The request itself declares them. Measured
on the BFCL v4 held-out replay (16 tokens per verify; `python -m bench.ngram_bench`, with and
without it side by side): tau 4.39 -> 4.80 on single-turn questions, 6.24 -> 6.66 on live ones,
12.13 -> 12.24 multi-turn, where earlier calls in the context already show the names, 7.52 -> 7.95
in all; level on the chained long agent conversations of bench.long_context (7.26 -> 7.25). Ranking the candidates as a token tree added nothing (+0.1%).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from common.chat_format import CALL_OPEN, TOOL_CLOSE, TOOL_OPEN, TURN_OPEN
from ngram.draft import Draft
from ngram.drafter import DrafterConfig, NgramDrafter

_DECLARATION = TOOL_OPEN + "declaration:"
_CALL_PREFIX = CALL_OPEN + "call:"
_DECL_HEAD = re.compile(re.escape(_DECLARATION) + r"([^{]+)\{")
_CALL_IN_PROGRESS = re.compile(re.escape(_CALL_PREFIX) + r"([^{]+)\{(.*),$", re.S)
_KEY = re.compile(r"(?:^|,)([A-Za-z_]\w*):")
_WORD = re.compile(r"[a-z0-9]+")
_CONFIDENCE = 0.9  # a declared name or parameter: as sure as a long n-gram match
MAX_DECLARATION_TOKENS = 8192  # one declaration's span at most (its description and parameters)
_PARSED_KEPT = 4096  # parsed declaration spans kept for the next turns
_MARKER_SLACK = 4  # tokens before the word `declaration` that hold `<|tool>` (merged or not)


def make_drafter(index, config: DrafterConfig | None = None, tokenizer: Any = None):
    """The drafter the server serves with: the n-gram drafter, wrapped in ToolSchemaDrafter when
    `config.tool_schema` is on and a Hugging Face tokenizer is given (a tokenizer without
    encode/decode/convert_ids_to_tokens, such as a test's byte tokenizer, leaves it unwrapped)."""
    config = config or DrafterConfig()
    inner = NgramDrafter(index, config)
    usable = all(hasattr(tokenizer, a) for a in ("encode", "decode", "convert_ids_to_tokens", "__len__"))
    return ToolSchemaDrafter(inner, tokenizer) if (config.tool_schema and usable) else inner


def parse_declarations(text: str) -> dict[str, list[str]]:
    """{function name: its parameter names in declaration order} of the declarations in `text`."""
    out: dict[str, list[str]] = {}
    for head in _DECL_HEAD.finditer(text):
        end = text.find(TOOL_CLOSE, head.end())
        end = len(text) if end < 0 else end
        props = text.find("properties:{", head.end(), end)
        params: list[str] = []
        if props >= 0:  # the keys at depth 0 of properties:{KEY:{...},KEY:{...}}
            depth, key = 0, ""
            for ch in text[props + len("properties:{"):end]:
                if ch == "{":
                    if depth == 0 and key.endswith(":"):
                        params.append(key[:-1].lstrip(","))
                    depth, key = depth + 1, ""
                elif ch == "}":
                    if depth == 0:
                        break
                    depth -= 1
                elif depth == 0:
                    key += ch
        out.setdefault(head.group(1), params)
    return out


class _Vocabulary:
    """What the sessions need of a tokenizer, computed once per tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.encode = lambda s: list(tokenizer.encode(s, add_special_tokens=False))
        fast = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer: no per-id Python checks
        if fast is not None and hasattr(fast, "decode"):
            self.decode = lambda ids: fast.decode(np.asarray(ids, dtype=np.int64).tolist(), skip_special_tokens=False)
        else:
            self.decode = lambda ids: tokenizer.decode([int(i) for i in ids])
        self.call_open = self.encode(CALL_OPEN)
        self.declaration = self.encode("declaration")
        self.user_turn = self.encode(TURN_OPEN + "user\n")
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.ends_with_comma = np.array([bool(p) and p.endswith(",") for p in pieces], dtype=bool)
        self._openings: dict[tuple, list[int]] = {}

    def opening(self, name: str, params: list[str]) -> list[int]:
        key = (name, params[0] if params else None)
        if key not in self._openings:
            self._openings[key] = self.encode(_CALL_PREFIX + name + ("{" + params[0] + ":" if params else ""))
        return self._openings[key]


_VOCABULARIES: dict[int, _Vocabulary] = {}


def _vocabulary(tokenizer) -> _Vocabulary:
    v = _VOCABULARIES.get(id(tokenizer))
    if v is None or v.tokenizer is not tokenizer:
        v = _VOCABULARIES[id(tokenizer)] = _Vocabulary(tokenizer)
    return v


class ToolSchemaDrafter:
    def __init__(self, inner: NgramDrafter, tokenizer):
        self.inner = inner
        self.vocab = _vocabulary(tokenizer)
        self._parsed: dict[bytes, dict[str, list[str]]] = {}  # a declaration span's ids -> its parse
        self._previous = None  # (the last prompt read, its spans (position, parse), its last user turn)

    # the server's reload carries the online overlay from one drafter to the next
    @property
    def overlay(self):
        return self.inner.overlay

    @overlay.setter
    def overlay(self, value):
        self.inner.overlay = value

    def __getattr__(self, name: str):
        # everything else (index, config, lookup, ...) is the n-gram drafter's: callers that look at
        # the drafter in service see the one inside
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def session(self) -> "ToolSchemaSession":
        return ToolSchemaSession(self, self.inner.session())

    def declarations(self, ids: np.ndarray) -> tuple[dict[str, list[str]], int]:
        """The declarations in a prompt's ids, and where its last user turn begins (-1: none).
        Each declaration's span is decoded and parsed once; a prompt that extends the previous one
        (the next turn of a conversation) is scanned only past what was read before. Spans are
        found by the word `declaration` (a tokenizer may merge `<|tool>`'s and `<tool|>`'s
        characters with their neighbours, so those are looked for in the decoded text): from a few
        tokens before one to a few tokens before the next, at most MAX_DECLARATION_TOKENS."""
        prev = self._previous
        spans: list[tuple[int, dict]] = []
        scan_from, last_user = 0, -1
        if prev is not None and len(ids) >= len(prev[0]) and np.array_equal(ids[:len(prev[0])], prev[0]):
            # spans that ended before the old end's reach stay as they were; later ones are read again
            keep_before = len(prev[0]) - MAX_DECLARATION_TOKENS - _MARKER_SLACK
            spans = [(at, parsed) for at, parsed in prev[1] if at < keep_before]
            scan_from = max(0, keep_before)
            last_user = prev[2]
        words = [at + scan_from for at in _find_all(ids[scan_from:], self.vocab.declaration)]
        for i, at in enumerate(words):
            start = max(0, at - _MARKER_SLACK)
            stop = min(len(ids), at + MAX_DECLARATION_TOKENS,
                       words[i + 1] - _MARKER_SLACK if i + 1 < len(words) else len(ids))
            span = ids[start:max(stop, at + 1)]
            key = span.tobytes()
            parsed = self._parsed.get(key)
            if parsed is None:
                if len(self._parsed) >= _PARSED_KEPT:  # a long-running server: keep the memory bounded
                    self._parsed.clear()
                parsed = self._parsed[key] = parse_declarations(self.vocab.decode(span))
            spans.append((at, parsed))
        users = _find_all(ids[max(0, scan_from - len(self.vocab.user_turn)):], self.vocab.user_turn)
        if users:
            last_user = users[-1] + max(0, scan_from - len(self.vocab.user_turn))
        self._previous = (ids.copy(), spans, last_user)
        out: dict[str, list[str]] = {}
        for _, parsed in spans:
            for name, params in parsed.items():
                out.setdefault(name, params)
        return out, last_user


class _Node:
    """A node of the trie of a session's call openings: `best` is the rank of the likeliest opening
    through it, `head_end` marks the end of a function's name (`<|tool_call>call:NAME`)."""

    __slots__ = ("children", "best", "head_end")

    def __init__(self, best: int):
        self.children: dict[int, _Node] = {}
        self.best, self.head_end = best, False


class ToolSchemaSession:
    """One request: the inner session, the prompt's declarations as a trie of call openings, and
    where the tokens of the current call (or of the turn, before any call) stand in it."""

    def __init__(self, owner: ToolSchemaDrafter, inner):
        self.owner, self.inner, self.vocab = owner, inner, owner.vocab
        self.functions: dict[str, list[str]] = {}
        self.openings: list[tuple[int, ...]] = []  # ids of each opening, most likely first
        self.root: _Node | None = None
        self.prompt_len = 0
        self.segment_start = 0   # where the tokens matched against the openings begin
        self.scanned = 0         # context scanned for `<|tool_call>` so far
        self.node: _Node | None = None  # where the segment's first `depth` tokens lead (None: off the trie)
        self.depth = 0
        self.named = False       # the segment already holds a whole declared name

    def prepare(self, context_ids) -> None:
        self.inner.prepare(context_ids)
        ids = np.asarray(context_ids, dtype=np.int64)
        self.functions, last_user = self.owner.declarations(ids) if len(ids) else ({}, -1)
        self.prompt_len = self.segment_start = self.scanned = len(ids)
        words = set(_WORD.findall(self.vocab.decode(ids[last_user:]).lower())) if last_user >= 0 else set()
        # functions in the order the opening is offered: most words shared with the user's last
        # message first (a name's words split at '_', '.' and case), declaration order on ties
        score = lambda name: len(set(_WORD.findall(re.sub(r"([a-z])([A-Z])", r"\1 \2", name).lower())) & words)
        ranked = sorted(enumerate(self.functions.items()), key=lambda x: (-score(x[1][0]), x[0]))
        self.openings, self.root = [], (_Node(0) if ranked else None)
        for rank, (_, (name, params)) in enumerate(ranked):
            opening = tuple(self.vocab.opening(name, params))
            head = len(self.vocab.opening(name, []))
            self.openings.append(opening)
            node = self.root
            for i, token in enumerate(opening):
                node = node.children.setdefault(token, _Node(rank))
                if i + 1 == head:
                    node.head_end = True
        self._restart()

    def _restart(self) -> None:
        self.node, self.depth, self.named = self.root, 0, False

    def propose(self, context_ids, max_tokens: int) -> Draft:
        draft = self.inner.propose(context_ids, max_tokens)
        if self.root is None or max_tokens <= 0 or len(context_ids) < self.prompt_len:
            return draft
        self._follow(context_ids)
        if self.node is not None and self.node.children:  # the tokens may still be a call's opening
            opening = self._opening(draft, max_tokens)
            if opening is not None:
                return opening
        last = int(context_ids[-1]) if self.named else -1  # parameters only inside a declared function's call
        if 0 <= last < len(self.vocab.ends_with_comma) and self.vocab.ends_with_comma[last]:
            segment = [int(t) for t in context_ids[self.segment_start:]]
            return self._next_parameter(segment, draft, max_tokens) or draft
        return draft

    def _follow(self, context_ids) -> None:
        """Move segment_start to the last `<|tool_call>` in the generated tokens (each token is
        scanned once), and walk the trie over the segment's new tokens."""
        marker = self.vocab.call_open
        n = len(context_ids)
        lo = max(self.prompt_len, self.scanned - len(marker) + 1)
        if n - lo >= len(marker):
            new = context_ids[lo:n]
            new = new.tolist() if hasattr(new, "tolist") else list(new)
            first, k = marker[0], len(marker)
            # a few tokens a step: a Python scan costs less than numpy's per-call overhead here
            found = [i for i, t in enumerate(new[: len(new) - k + 1]) if t == first and new[i:i + k] == marker]
            if found and lo + found[-1] != self.segment_start:
                self.segment_start = lo + found[-1]
                self._restart()
        self.scanned = n
        node = self.node
        while node is not None and self.segment_start + self.depth < n:
            node = node.children.get(int(context_ids[self.segment_start + self.depth]))
            self.depth += 1
            self.named = self.named or (node is not None and node.head_end)
        self.node = node

    def _opening(self, draft: Draft, max_tokens: int) -> Draft | None:
        if len(draft):
            if self.named:
                return draft  # the call's function is named already: the inner draft goes on from there
            node = self.node
            for token in draft.main_chain().tokens:  # does the inner draft name a declared function?
                node = node.children.get(int(token))
                if node is None:
                    break
                if node.head_end:
                    return draft
            else:
                return draft  # it ends inside a declared opening
        rest = list(self.openings[self.node.best][self.depth:self.depth + max_tokens])
        return Draft(rest, [_CONFIDENCE] * len(rest), "schema", self.depth)

    def _next_parameter(self, segment: list[int], draft: Draft, max_tokens: int) -> Draft | None:
        text = self.vocab.decode(segment)
        call = _CALL_IN_PROGRESS.match(text)
        params = self.functions.get(call.group(1)) if call else None
        if not params:
            return None
        used = set(_KEY.findall(call.group(2)))
        unused = [p for p in params if p not in used]
        if not unused:
            return None
        inner = self.vocab.decode(draft.main_chain().tokens) if len(draft) else ""
        if any(inner.startswith(p + ":") for p in unused):
            return None
        ids = self.vocab.encode(text + unused[0] + ":")
        if ids[:len(segment)] != segment:  # the new text would re-tokenize what stands: no draft of it
            return None
        rest = ids[len(segment):][:max_tokens]
        return Draft(rest, [_CONFIDENCE] * len(rest), "schema", len(segment)) if rest else None

    def feedback(self, drafted: int, accepted: int) -> None:
        self.inner.feedback(drafted, accepted)

    def finish(self, context_ids=None) -> None:
        self.inner.finish(context_ids)


def _find_all(ids: np.ndarray, pattern: list[int]) -> list[int]:
    """Start positions of `pattern` in `ids` (vectorized: one comparison of the array per token
    of the pattern, whatever the number of partial hits)."""
    n = len(pattern)
    if not n or len(ids) < n:
        return []
    span = len(ids) - n + 1
    hit = ids[:span] == pattern[0]
    for j in range(1, n):
        hit &= ids[j:j + span] == pattern[j]
    return np.flatnonzero(hit).tolist()
