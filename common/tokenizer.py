"""The target tokenizer: loading it, fingerprinting it, and cutting conversations into token turns.

Contract:
- `load_tokenizer(path_or_None)`: a local Hugging Face model/tokenizer directory (default: the bundled
  Gemma 3 270M model's, see common.bundled_model); offline only.
- `tokenizer_fingerprint(tok)`: sha256 of the vocabulary (token -> id pairs, sorted). An index records
  it; loading an index with a tokenizer of another fingerprint is refused.
- `conversation_turns(fmt, tok, messages, tools)`: per assistant message, (context ids, target ids):
  exactly the tokens the target sees before that turn and the tokens it generates for it. The built-in
  format tokenizes the whole conversation once and cuts it at character offsets (linear time);
  a chat template goes through ChatFormat.turn_token_ids.
"""
from __future__ import annotations

import bisect
import hashlib
from functools import lru_cache
from pathlib import Path

from common.chat_format import ChatFormat


def load_tokenizer(path: str | Path | None = None):
    from transformers import AutoTokenizer

    from common.bundled_model import bundled_model_dir

    where = Path(path) if path else bundled_model_dir()
    if not where.exists():
        raise FileNotFoundError(f"tokenizer directory {where} does not exist")
    return AutoTokenizer.from_pretrained(str(where), local_files_only=True)


def tokenizer_fingerprint(tok) -> str:
    return _fingerprint_of(id(tok), tok)


@lru_cache(maxsize=8)
def _fingerprint_of(_key: int, tok) -> str:
    h = hashlib.sha256()
    for token, token_id in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{token_id}\t{token}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def conversation_turns(fmt: ChatFormat, tok, messages: list[dict], tools: list[dict]) -> list[tuple[list[int], list[int]]]:
    if fmt.uses_template or not getattr(tok, "is_fast", False):
        return fmt.turn_token_ids(tok, messages, tools)
    text, spans = fmt.render_with_spans(messages, tools)
    if not spans:
        return []
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = enc["input_ids"], [a for a, _ in enc["offset_mapping"]]
    turns = []
    for a, b in spans:
        i, j = bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)
        turns.append((ids[:i], ids[i:j]))
    return turns


def indexed_turns(fmt: ChatFormat, tok, conversations, anchor_tokens: int, lead_chars: int = 256,
                  on_error=None) -> list[list[int]]:
    """What the index stores per assistant turn: the last `anchor_tokens` prompt tokens + the turn.

    Fast path for the built-in format: each turn is tokenized with only `lead_chars` characters of
    the text before it (token boundaries are local, so the ids match a whole-conversation
    tokenization), all turns of the batch in one call to the fast tokenizer.
    `on_error(conversation, exception)`: a conversation the format cannot render (a chat template's
    own refusal, say) is handed to it and left out; without it the exception propagates.
    """
    def rendered(render, conv):
        try:
            return render()
        except Exception as e:   # whatever a template raises about one conversation
            if on_error is None:
                raise
            on_error(conv, e)
            return None

    if fmt.uses_template or not getattr(tok, "is_fast", False):
        out = []
        for conv in conversations:
            turns = rendered(lambda: fmt.turn_token_ids(tok, conv.messages, conv.tools), conv)
            for ctx, target in turns or []:
                if target:
                    out.append(ctx[-anchor_tokens:] + target if anchor_tokens else target)
        return out
    pieces: list[tuple[str, int]] = []
    for conv in conversations:
        done = rendered(lambda: fmt.render_with_spans(conv.messages, conv.tools), conv)
        if done is None:
            continue
        text, spans = done
        for a, b in spans:
            lead = max(0, a - lead_chars)
            pieces.append((text[lead:b], a - lead))
    if not pieces:
        return []
    enc = tok([p for p, _ in pieces], add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for (piece, cut), ids, offsets in zip(pieces, enc["input_ids"], enc["offset_mapping"]):
        i = bisect.bisect_left([a for a, _ in offsets], cut)
        if i < len(ids):
            out.append(ids[max(1 if cut else 0, i - anchor_tokens) :])  # token 0 may be cut mid-word
    return out
