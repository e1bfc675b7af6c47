"""`python -m bench.grammar_cost [--rounds 5]`: what a grammar costs per generated token.

On the bundled Gemma 3 270M tokenizer (262,144 tokens), for each constraint kind (a JSON schema,
any JSON object, a Gemma 4 tool call), a few valid outputs are walked token by token as the engine
walks them: at each position the mask is computed, then the token consumed. Timed per token:
- `llg mask`: llguidance alone filling its bitmask (llguidance.numpy.fill_next_token_bitmask);
- `mask_logits`: what the engine pays to choose a token, GrammarMatcher.mask_logits on fp32 logits
  (the bitmask, unpacking it to a bool vector, stop tokens, masked_fill);
- `consume`: advancing the matcher by the chosen token.
Median and p90 in microseconds, over every position of every output in every round; the first round
on a fresh constraint (llguidance builds its lexer states lazily) is reported apart as `cold`.
Also the one-off costs: the compiler (llguidance's tokenizer) and compiling each constraint; and,
unless --no-engine, the grammar's share of real decoding: the bundled model (fp32, CPU) generating
under each constraint, grammar seconds (RequestStats.grammar_s) per token beside forward seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "Current weather in a city",
             "parameters": {"type": "object", "properties": {
                 "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                 "required": ["city"]}}},
         {"type": "function", "function": {
             "name": "search_web", "description": "Search the web",
             "parameters": {"type": "object", "properties": {
                 "query": {"type": "string"}, "max_results": {"type": "integer"}}, "required": ["query"]}}}]
OUTPUTS = {
    "json_schema": ['{"name": "Alice", "age": 30, "city": "Paris"}',
                    '{\n    "name": "John Doe",\n    "age": 20,\n    "city": "New York City",\n'
                    '    "tags": ["a", "b"]\n}'],
    "json_object": ['{"weather": {"today": "sunny", "temperature": 21.5, "wind": [3, 4]}, "ok": true}',
                    '{"items": [{"id": 1, "name": "first item"}, {"id": 2, "name": null}]}'],
    "tool_call": ['<|tool_call>call:get_weather{city:<|"|>Tokyo<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>',
                  '<|tool_call>call:search_web{query:<|"|>llguidance token masks, speed<|"|>,'
                  'max_results:5}<tool_call|>'],
}


def _constraint(compiler, kind):
    if kind == "json_schema":
        return compiler.json_schema(SCHEMA)
    if kind == "json_object":
        return compiler.json_object()
    return compiler.tool_call(TOOLS, parallel=False)


def _walk(constraint, compiler, ids_list, stop_ids, logits):
    """Per-token seconds (llg mask, mask_logits, consume) walking each output once."""
    llg, masked, consumed = [], [], []
    bitmask = llg_numpy.allocate_token_bitmask(1, compiler.ll_tokenizer.vocab_size)
    for ids in ids_list:
        raw = llguidance.LLMatcher(compiler.ll_tokenizer, constraint.grammar, log_level=0)
        matcher = constraint.start(stop_ids)
        for token in ids:
            t0 = time.perf_counter()
            llg_numpy.fill_next_token_bitmask(raw, bitmask)
            t1 = time.perf_counter()
            row = matcher.mask_logits(logits)
            t2 = time.perf_counter()
            matcher.consume(token)
            t3 = time.perf_counter()
            assert bool(torch.isfinite(row[token])), "a valid output's token was masked"
            raw.consume_token(token)
            llg.append(t1 - t0)
            masked.append(t2 - t1)
            consumed.append(t3 - t2)
    return llg, masked, consumed


def _stats(seconds: list[float]) -> str:
    us = np.asarray(seconds) * 1e6
    return f"{np.median(us):8.0f} {np.percentile(us, 90):8.0f}"


class _Tee(io.StringIO):
    """Prints through and keeps a copy: the printed table is also the results file."""

    def write(self, text: str) -> int:
        sys.__stdout__.write(text)
        return super().write(text)


def main(argv: list[str] | None = None) -> int:
    tee = _Tee()
    with contextlib.redirect_stdout(tee):
        code = _measure(argv)
    from bench.results import write_results

    write_results(Path("bench/results"), "grammar_cost", {"printed": tee.getvalue()},
                  "```\n" + tee.getvalue().rstrip() + "\n```\n")
    return code


def _measure(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grammar_cost", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-engine", action="store_true", help="skip the decoding measurement (loads the model)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from common.tokenizer import load_tokenizer
    from server.grammar import GrammarCompiler

    tokenizer = load_tokenizer(None)
    t0 = time.perf_counter()
    compiler = GrammarCompiler.for_tokenizer(tokenizer)
    print(f"compiler (llguidance tokenizer, {compiler.ll_tokenizer.vocab_size} tokens): "
          f"{time.perf_counter() - t0:.2f} s, once per loaded model")
    logits = torch.randn(compiler.vocab_size)
    stop_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    print(f"{'constraint':12} {'round':5} {'tokens':>6} | {'llg mask us':>17} | {'mask_logits us':>17} | "
          f"{'consume us':>17}")
    print(f"{'':12} {'':5} {'':>6} | {'median':>8} {'p90':>8} | {'median':>8} {'p90':>8} | {'median':>8} {'p90':>8}")
    for kind, texts in OUTPUTS.items():
        ids_list = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        t0 = time.perf_counter()
        constraint = _constraint(compiler, kind)
        compile_ms = (time.perf_counter() - t0) * 1e3
        cold = _walk(constraint, compiler, ids_list, stop_ids, logits)
        warm = [[], [], []]
        for _ in range(args.rounds):
            for acc, got in zip(warm, _walk(constraint, compiler, ids_list, stop_ids, logits)):
                acc += got
        n = sum(map(len, ids_list))
        for label, (llg, masked, consumed) in (("cold", cold), ("warm", warm)):
            print(f"{kind:12} {label:5} {n if label == 'cold' else n * args.rounds:6d} | {_stats(llg)} | "
                  f"{_stats(masked)} | {_stats(consumed)}")
        print(f"{'':12} compile {compile_ms:.1f} ms")
    if not args.no_engine:
        _in_the_engine(compiler)
    return 0


PROMPTS = {"json_schema": "Alice is 30 years old and lives in Paris.\nThe same facts as JSON: ",
           "json_object": "A JSON object about the weather today:\n",
           "tool_call": None}  # the chat format's prompt for a user question with TOOLS


def _in_the_engine(compiler) -> None:
    from common.chat_format import ChatFormat
    from server.engine import Engine, EngineConfig, GenerationParams
    from server.model_loading import load_target

    target = load_target(None)
    engine = Engine(target, None, EngineConfig(adaptive=False))
    tok = target.tokenizer
    print("in the engine (bundled 270M, fp32, CPU, greedy, plain decoding, torch threads 1):")
    for kind, text in PROMPTS.items():
        if text is None:  # the rendered chat prompt starts with the BOS text itself
            text = ChatFormat.for_tokenizer(tok).render_prompt(
                [{"role": "user", "content": "What's the weather in Tokyo?"}], TOOLS)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(text)["input_ids"]
        stats, out, finish = None, [], None
        for chunk in engine.generate(ids, GenerationParams(max_tokens=64, draft=False,
                                                           constraint=_constraint(compiler, kind))):
            stats, finish = chunk.stats, chunk.finish_reason
            out += chunk.token_ids
        n = stats.completion_tokens
        print(f"  {kind:12} {n:3d} tokens ({finish}): grammar {stats.grammar_s / n * 1e3:5.2f} ms/token, "
              f"forward {stats.forward_s / max(n - 1, 1) * 1e3:6.1f} ms/token; {tok.decode(out)[:70]!r}")


if __name__ == "__main__":
    raise SystemExit(main())
