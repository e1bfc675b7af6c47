"""Distillation: the target's own completions for recorded contexts, written as traces.

`python -m index distill --traces PATH... --out FILE [--model M] [--max-tokens N]` replays the
context of every assistant turn in the traces (Claude Code sessions, conversations produced by another
model, ...) through the target, greedily, and writes one OpenAI-format conversation per turn:
the recorded context plus the target's own reply (content and tool calls parsed back from its
format). An index built from these predicts what the target will say, not what another model said.
Decoding uses Sailfish's engine with context-only drafting, which is lossless: the completions are
exactly the target's greedy output. Turns whose prompt exceeds --max-prompt tokens are skipped
(counted in the summary).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class DistillSummary:
    conversations: int = 0
    turns: int = 0
    skipped_long: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    def text(self) -> str:
        return (f"distilled {self.turns} turns from {self.conversations} conversations "
                f"({self.generated_tokens} generated tokens, {self.seconds:.0f} s; "
                f"{self.skipped_long} turns skipped as longer than --max-prompt)")


def distill(conversations, out_path: Path, engine, max_tokens: int = 256, max_prompt: int = 4096,
            progress: bool = True) -> DistillSummary:
    from tqdm import tqdm

    from common.chat_format import ChatFormat
    from server.engine import GenerationParams

    tok = engine.tokenizer
    fmt = ChatFormat.for_tokenizer(tok)
    params = GenerationParams(max_tokens=max_tokens, stop_token_ids=frozenset(fmt.stop_token_ids(tok)),
                              stop_strings=tuple(fmt.stop_strings()))
    summary = DistillSummary()
    started = time.perf_counter()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".partial")
    with open(tmp, "w") as out:
        for conv in tqdm(conversations, desc="distilling", unit="conv", disable=not progress, file=sys.stderr):
            summary.conversations += 1
            for i, message in enumerate(conv.messages):
                if message["role"] != "assistant":
                    continue
                context = conv.messages[:i]
                ids = tok(fmt.render_prompt(context, conv.tools), add_special_tokens=False)["input_ids"]
                if len(ids) > max_prompt:
                    summary.skipped_long += 1
                    continue
                text, n = "", 0
                for chunk in engine.generate(ids, params):
                    text += chunk.text
                    n += len(chunk.token_ids)
                parsed = fmt.parse_generated(text)
                reply = {"role": "assistant", "content": parsed.content or None}
                if parsed.tool_calls:
                    reply["tool_calls"] = [{"id": f"call_{k}", "type": "function",
                                            "function": {"name": c["name"], "arguments": c["arguments"]}}
                                           for k, c in enumerate(parsed.tool_calls)]
                out.write(json.dumps({"messages": context + [reply], "tools": conv.tools}) + "\n")
                summary.turns += 1
                summary.generated_tokens += n
    tmp.replace(out_path)
    summary.seconds = time.perf_counter() - started
    return summary


def load_distill_engine(model: str | None):
    from ngram.drafter import NgramDrafter
    from server.engine import Engine, EngineConfig
    from server.model_loading import load_target

    target = load_target(model)
    return Engine(target, NgramDrafter(None), EngineConfig())
