"""Constrained decoding: grammars compiled by llguidance, and the per-request matcher the engine drives.

Why llguidance: a well-kept grammar library (JSON schema, Lark-style CFGs, regexes; used by
llama.cpp, vLLM and SGLang) with a mask over Gemma's 262k vocabulary in about 20 microseconds
(median; `python -m bench.grammar_cost`); it has no dependencies.

Building a constraint (the HTTP wiring does this). One compiler per loaded tokenizer (a Hugging
Face fast tokenizer), built once: 3-6 s for Gemma's vocabulary on a busy 2-core machine; after that
a constraint compiles in a few milliseconds. Every builder raises ValueError for what it cannot
compile (an HTTP 400):

    compiler = GrammarCompiler.for_tokenizer(target.tokenizer, vocab_size=engine.vocab_size)
    # response_format {"type": "json_schema", "json_schema": {"schema": S}}
    constraint = compiler.json_schema(S)                 # lenient=True: ignore unsupported keywords
    # response_format {"type": "json_object"}
    constraint = compiler.json_object()
    # tool_choice "required" (any offered tool) or {"type": "function", "function": {"name": N}}
    # with the built-in Gemma 4 format (ChatFormat.uses_template is False):
    constraint = compiler.tool_call(tools)               # one or more calls (parallel=False: one)
    constraint = compiler.tool_call(tools, named=N)      # exactly one call of N
    constraint = compiler.tool_call(tools, optional=True)  # "auto" with strict tools: text, then calls or none
    # with a chat template whose model writes JSON calls, e.g. between <tool_call>\\n and \\n</tool_call>:
    constraint = compiler.tool_call_json(tools, named=None, parallel=True,
                                         open_marker="<tool_call>\\n", close_marker="\\n</tool_call>")
    # any other grammar: compiler.lark(text)
    params = GenerationParams(max_tokens=..., constraint=constraint, stop_token_ids=..., ...)

A `Constraint` is immutable and reusable (cache it per schema if you like); the engine calls
`constraint.start(stop_token_ids)` once per request for a fresh `GrammarMatcher`, with the model's
EOS and the request's stop_token_ids: those are the tokens a grammar may end with (so pass the chat
format's, ChatFormat.stop_token_ids, e.g. `<|tool_response>` after parallel calls). The output of a
constrained request is in the grammar's language when finish_reason is "stop" because the grammar
completed or the model chose a stop token where the grammar may end; with "length" (max_tokens) or
a stop string it is a prefix of it. Generated text is parsed as usual: `json.loads`, or
`common.chat_format.parse_generated` for tool calls (see server.tool_grammars for what the tool
grammars enforce of a `parameters` schema).

GrammarMatcher contract (the engine's view; it keeps the matcher equal to the committed tokens):
- `mask_logits(logits)`: the logits of the next position with every token the grammar does not
  allow there set to -inf. Allowed: the grammar's tokens, plus the request's stop tokens exactly
  when the grammar is accepting (it may end here). `allowed()` is the same as a bool tensor.
- `consume(token)`: advance by one committed token (never a stop token); GrammarError if the
  grammar rejects it (then the matcher is unusable). `rollback(n)`: forget the last n consumed.
- `validate_tokens(tokens)`: how many leading tokens the grammar accepts from the current state
  (stop tokens end the count); the state does not change. Used to cut drafts before verification.
- `is_accepting()`: the tokens so far are a complete sentence. `is_stopped()`: complete and
  nothing but a stop token can follow (the engine then finishes with "stop").
- `seconds`: time spent in llguidance and in masking (the cost the bench reports per token).
"""
from __future__ import annotations

import json
import time
from typing import Any, Iterable, Mapping

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from server.tool_grammars import JSON_WHITESPACE, refuse_unsatisfiable, tool_call_grammar, tool_call_json_grammar



class GrammarError(RuntimeError):
    """The grammar rejected a token it was asked to consume, or allows nothing while incomplete."""


class GrammarCompiler:
    """Compiles grammars for one tokenizer. `vocab_size` is the width of the model's logits."""

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, vocab_size: int | None = None,
                 special_tokens: Mapping[str, int] | None = None):
        self.ll_tokenizer = ll_tokenizer
        self.vocab_size = int(vocab_size if vocab_size is not None else ll_tokenizer.vocab_size)
        self.special_tokens = dict(special_tokens or {})  # text -> id of the tokenizer's special tokens

    @classmethod
    def for_tokenizer(cls, hf_tokenizer, vocab_size: int | None = None) -> "GrammarCompiler":
        """From a Hugging Face fast tokenizer (llguidance.hf; seconds for Gemma's 262k vocabulary).
        The tokenizer's special tokens are kept by text, so grammars can name them as tokens."""
        import llguidance.hf

        ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        special = {str(added): token for token, added in hf_tokenizer.added_tokens_decoder.items()
                   if token < ll_tokenizer.vocab_size and ll_tokenizer.is_special_token(token)}
        return cls(ll_tokenizer, vocab_size, special)

    def json_schema(self, schema: dict | str, lenient: bool = False) -> "Constraint":
        """response_format json_schema. `lenient`: ignore keywords llguidance does not support
        instead of refusing the schema. A schema's own `x-guidance` options (llguidance's JSON
        options: whitespace, separators, lenient) win over ours."""
        schema = json.loads(schema) if isinstance(schema, str) else schema
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        refuse_unsatisfiable(schema)
        own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
        defaults: dict[str, Any] = {"lenient": lenient}
        if "whitespace_pattern" not in own and "whitespace_flexible" not in own:  # else the pattern would win
            defaults["whitespace_pattern"] = JSON_WHITESPACE
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
        return Constraint(self, grammar, "json_schema")

    def json_object(self) -> "Constraint":
        """response_format json_object: any JSON object."""
        return self.json_schema({"type": "object"})

    def lark(self, grammar: str) -> "Constraint":
        return Constraint(self, llguidance.LLMatcher.grammar_from_lark(grammar), "lark")

    def tool_call(self, tools: list[dict], named: str | None = None, parallel: bool = True,
                  optional: bool = False) -> "Constraint":
        """Calls in the built-in Gemma 4 format (server.tool_grammars.tool_call_grammar): one or
        more with `parallel`, else exactly one; exactly one call of `named` when given. `optional`:
        free text first, then no call or the calls (tool_choice "auto" with strict tools)."""
        text = tool_call_grammar(tools, named, parallel and named is None, self.special_tokens, optional)
        return self.lark(text)

    def tool_call_json(self, tools: list[dict], named: str | None = None, parallel: bool = False,
                       open_marker: str = "", close_marker: str = "") -> "Constraint":
        """Calls as JSON objects between a chat template's markers (tool_call_json_grammar)."""
        return self.lark(tool_call_json_grammar(tools, named, parallel, open_marker, close_marker,
                                                self.special_tokens))


class Constraint:
    """A compiled grammar: immutable, reusable across requests; `start` gives a request its matcher."""

    def __init__(self, compiler: GrammarCompiler, grammar: str, kind: str):
        self.compiler, self.grammar, self.kind = compiler, grammar, kind
        self._initial = llguidance.LLMatcher(compiler.ll_tokenizer, grammar, log_level=0)
        if self._initial.is_error():
            raise ValueError(f"invalid {kind} grammar: {self._initial.get_error()}")

    def start(self, stop_token_ids: Iterable[int] = ()) -> "GrammarMatcher":
        return GrammarMatcher(self._initial.deep_copy(), self.compiler.vocab_size,
                              self.compiler.ll_tokenizer, frozenset(int(t) for t in stop_token_ids))

    def __repr__(self) -> str:
        return f"Constraint({self.kind}, {len(self.grammar)} chars)"


class GrammarMatcher:
    """One request's grammar state; see the module docstring for the contract."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, ll_tokenizer: llguidance.LLTokenizer,
                 stop_token_ids: frozenset[int]):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        grammar_eos = frozenset(ll_tokenizer.eos_tokens)
        self._ends = stop_token_ids | grammar_eos  # tokens that end a draft's count
        # llguidance's own EOS bits are replaced by the request's stop tokens (allowed when accepting)
        self._grammar_eos = np.array(sorted(t for t in grammar_eos if t < vocab_size), dtype=np.int64)
        self._stops = np.array(sorted(t for t in stop_token_ids if 0 <= t < vocab_size), dtype=np.int64)
        self._bitmask = llg_numpy.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        self.consumed = 0
        self.seconds = 0.0

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens allowed at the next position."""
        return torch.from_numpy(self._allowed())

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] with the tokens not allowed next set to -inf (a new tensor). Logits wider
        than the vocabulary: the extra ids are never allowed. On the CPU this is one single-threaded
        numpy pass: right after a forward, torch's masked_fill over the vocabulary waited for its
        second thread on a busy 2-core machine (measured in the engine on the 270M: 25 ms a token,
        against 0.5 ms for this whole method)."""
        allowed = self._allowed()
        t0 = time.perf_counter()
        width = logits.shape[-1]
        if width != len(allowed):
            fitted = np.zeros(width, dtype=np.bool_)
            fitted[:min(width, len(allowed))] = allowed[:width]
            allowed = fitted
        if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
            source = logits.detach().numpy()
            masked = np.full(width, -np.inf, dtype=source.dtype)
            np.copyto(masked, source, where=allowed)
            out = torch.from_numpy(masked)
        else:
            out = logits.masked_fill(~torch.from_numpy(allowed).to(logits.device, non_blocking=True), float("-inf"))
        self.seconds += time.perf_counter() - t0
        return out

    def _allowed(self) -> np.ndarray:
        t0 = time.perf_counter()
        llg_numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little").view(np.bool_)
        allowed = np.zeros(self.vocab_size, dtype=np.bool_)
        width = min(self.vocab_size, len(bits))
        allowed[:width] = bits[:width]
        allowed[self._grammar_eos] = False
        if self._matcher.is_accepting():
            allowed[self._stops] = True
        if not allowed.any():
            raise GrammarError("the grammar allows no token here and is not complete")
        self.seconds += time.perf_counter() - t0
        return allowed

    def consume(self, token: int) -> None:
        t0 = time.perf_counter()
        ok = self._matcher.consume_token(int(token))
        self.seconds += time.perf_counter() - t0
        if not ok:
            raise GrammarError(f"the grammar rejects token {int(token)}: {self._matcher.get_error()}")
        self.consumed += 1

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if n > self.consumed or not self._matcher.rollback(n):
            raise GrammarError(f"cannot roll back {n} tokens ({self.consumed} consumed)")
        self.consumed -= n

    def validate_tokens(self, tokens: Iterable[Any]) -> int:
        tokens = [int(t) for t in tokens]
        end = next((i for i, t in enumerate(tokens) if t in self._ends), len(tokens))
        if end == 0:
            return 0
        t0 = time.perf_counter()
        valid = self._matcher.validate_tokens(tokens[:end])
        self.seconds += time.perf_counter() - t0
        return valid

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def is_stopped(self) -> bool:
        return self._matcher.is_stopped()
