"""The value a drafter returns, shared by every drafter and by the engine that verifies it.

Contract: `tokens` are the proposed next token ids (int32, possibly empty); `confidence[i]` is the
drafter's estimate (0..1) that tokens[:i+1] all match the target; `source` names where the draft came
from ("index", "context", "overlay", "suffix", ... or "none"); `match_length` is the number of context
tokens the drafter matched before proposing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Draft:
    tokens: np.ndarray
    confidence: np.ndarray
    source: str = "none"
    match_length: int = 0

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


EMPTY_DRAFT = Draft(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32))
