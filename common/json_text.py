"""Text that JSON can spell but no text encoding carries: lone UTF-16 surrogates.

Contract: `may_hold_lone_surrogate(raw)` is a cheap test of raw JSON (bytes or str): False means no
decoded string can hold a surrogate half (only a \\ud800-\\udfff escape decodes to one), True means
look. `lone_surrogate_at(value)` walks decoded JSON and returns the path ("messages[0].content")
of the first string or key holding a surrogate half not paired with another, else None. Such a
string cannot be encoded as UTF-8, so the tokenizer and every file writer would fail on it; callers
refuse it (a 400 from the server, a skipped trace line in the index builder).
"""
from __future__ import annotations

import re
from typing import Any

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


def may_hold_lone_surrogate(raw: bytes | str) -> bool:
    pattern = _SURROGATE_ESCAPE_BYTES if isinstance(raw, bytes) else _SURROGATE_ESCAPE
    return pattern.search(raw) is not None


def lone_surrogate_at(value: Any) -> str | None:
    stack = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not _encodes(v):
                return path or "(the value)"
        elif isinstance(v, dict):
            for key, item in v.items():
                inner = f"{path}.{key}" if path else str(key)
                if not _encodes(key):
                    return inner.encode("utf-8", "backslashreplace").decode()
                stack.append((item, inner))
        elif isinstance(v, list):
            stack.extend((item, f"{path}[{i}]") for i, item in reversed(list(enumerate(v))))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
