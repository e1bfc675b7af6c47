"""Token ids <-> marisa-trie key strings.

marisa-trie keys are text, so each token id becomes one Unicode code point. Invariants: the mapping is
order-preserving (a lower id gives a lower code point, so key order is token order), never produces a
surrogate or NUL, and covers ids 0 .. MAX_TOKEN_ID (the 262,144-token Gemma vocabulary fits with room).
"""
from __future__ import annotations

import numpy as np

_SURROGATE_START = 0xD800
_SURROGATE_SPAN = 0x800
MAX_TOKEN_ID = 0x10FFFF - _SURROGATE_SPAN - 1


def _to_code_points(ids: np.ndarray) -> np.ndarray:
    cps = ids.astype(np.int64) + 1  # +1 keeps NUL out of keys
    cps[cps >= _SURROGATE_START] += _SURROGATE_SPAN
    return cps


def encode(ids) -> str:
    """Token ids (any int sequence) -> key string, one character per token."""
    if len(ids) < 64:  # a Python join beats numpy set-up below this size
        ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
            raise ValueError(f"token id out of range 0..{MAX_TOKEN_ID}")
        return "".join(map(encode_one, ids))
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError(f"token id out of range 0..{MAX_TOKEN_ID}")
    return _to_code_points(arr).astype(np.uint32).tobytes().decode("utf-32-le")


def encode_one(token_id: int) -> str:
    cp = token_id + 1
    return chr(cp + _SURROGATE_SPAN if cp >= _SURROGATE_START else cp)


def decode(key: str) -> list[int]:
    out = []
    for c in key:
        cp = ord(c)
        out.append((cp - _SURROGATE_SPAN if cp >= _SURROGATE_START + _SURROGATE_SPAN else cp) - 1)
    return out
