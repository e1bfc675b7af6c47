"""Sailfish's drafter: token ids in, a draft out. Imports numpy and marisa-trie only, never torch."""
from ngram.draft import Draft, EMPTY_DRAFT

__all__ = ["Draft", "EMPTY_DRAFT"]
