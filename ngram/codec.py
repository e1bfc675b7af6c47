"""Token ids <-> marisa-trie key strings.

marisa-trie keys are text, so each token id becomes one Unicode code point. Invariants: the mapping is
order-preserving (a lower id gives a lower code point, so key order is token order), never produces a
surrogate or NUL, and covers ids 0 .. MAX_TOKEN_ID (the 262,144-token Gemma vocabulary fits with room).
"""
from __future__ import annotations

import os

import numpy as np

_SURROGATE_START = 0xD800
_SURROGATE_SPAN = 0x800
MAX_TOKEN_ID = 0x10FFFF - _SURROGATE_SPAN - 1


def encode(ids) -> str:
    """Token ids (any int sequence) -> key string, one character per token."""
    if len(ids) < 64:  # a Python join beats numpy set-up below this size
        return encode_ints(ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids])
    cps = np.asarray(ids, dtype=np.int64)
    if cps.min() < 0 or cps.max() > MAX_TOKEN_ID:
        raise ValueError(f"token id out of range 0..{MAX_TOKEN_ID}")
    cps = cps.astype(np.uint32)
    cps += 1  # keeps NUL out of keys
    cps += (cps >= _SURROGATE_START).view(np.uint8).astype(np.uint32) * _SURROGATE_SPAN
    return cps.tobytes().decode("utf-32-le")


def encode_ints(ids: list[int]) -> str:
    """encode() for a list of Python ints (the cheapest path for a few tokens)."""
    if len(ids) == 1:
        i = ids[0]
        if not 0 <= i <= MAX_TOKEN_ID:
            raise ValueError(f"token id out of range 0..{MAX_TOKEN_ID}")
        return chr(i + _SHIFTED if i >= _SHIFT_FROM else i + 1)
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        raise ValueError(f"token id out of range 0..{MAX_TOKEN_ID}")
    return "".join([chr(i + _SHIFTED if i >= _SHIFT_FROM else i + 1) for i in ids])


def decode(key: str) -> list[int]:
    return [cp - _SHIFTED if cp >= _UNSHIFT_FROM else cp - 1 for cp in map(ord, key)]


# id -> code point: id + 1, plus the surrogate span from the first id whose code point would be one
_SHIFT_FROM = _SURROGATE_START - 1
_SHIFTED = _SURROGATE_SPAN + 1
_UNSHIFT_FROM = _SURROGATE_START + _SURROGATE_SPAN


PYTHON_TWINS = {"encode": encode, "encode_ints": encode_ints, "decode": decode}

# The C twins (ngram/_speedups.c, see ngram.match): same results, faster. SPEEDUPS is the module, or
# None where it was not built or SAILFISH_PURE_PYTHON=1 asks for the Python twins; ngram.match uses it too.
try:
    from ngram import _speedups as SPEEDUPS
except ImportError:
    SPEEDUPS = None
if os.environ.get("SAILFISH_PURE_PYTHON"):
    SPEEDUPS = None
if SPEEDUPS is not None:
    encode, encode_ints, decode = SPEEDUPS.encode, SPEEDUPS.encode_ints, SPEEDUPS.decode
