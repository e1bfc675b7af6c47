"""The value a drafter returns, shared by every drafter and by the engine that verifies it.

Contract: `tokens` are the proposed next token ids (a sequence of ints, possibly empty: the n-gram
drafter returns a list, other drafters may return an int array); `confidence[i]` is the
drafter's estimate (0..1) that tokens[:i+1] all match the target; `source` names where the draft came
from ("index", "context", "overlay", "suffix", ... or "none"); `match_length` is the number of context
tokens the drafter matched before proposing.
"""
from __future__ import annotations



class Draft:
    """A plain slotted class, not a dataclass or arrays: the drafter builds one per step, and on a
    slow CPU a frozen dataclass plus two numpy arrays cost more than the rest of a cheap proposal."""

    __slots__ = ("tokens", "confidence", "source", "match_length")

    def __init__(self, tokens, confidence, source: str = "none", match_length: int = 0):
        self.tokens, self.confidence, self.source, self.match_length = tokens, confidence, source, match_length

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Draft({list(self.tokens)}, source={self.source!r}, match_length={self.match_length})"


EMPTY_DRAFT = Draft((), ())
