"""The transformers backend (any causal LM, CPU or GPU): a DynamicCache per sequence, kept for reuse.

Contract: `EagerBackend(model, prefix_budget_bytes)` implements server/backend.py's `Backend` with
transformers' own forward. Its cache holds the whole sequence on every layer, sliding-window
layers included: those attend exactly as transformers' windowed layer does (the same last window
of keys, the same mask), but keep every older position too, so rolling back to any position (a
rejected draft, or a prefix shared with a new prompt) stays exact however far it lies before the
end. KV-shared layers (Gemma 4) own no keys; they read their source layer's states,
which transformers passes along.

Prefix reuse. Finished sequences are kept in a `PrefixStore` under `prefix_budget_bytes` (0 turns
the cache off). A new prompt reuses the kept sequence with the longest common prefix, up to all
but its last token (whose logits are needed). When the prompt leaves the kept sequence inside that
sequence's own generated reply (an agent re-rendering its last turn) or past its end, the kept
KV is taken over and cropped in place: nothing is copied, and the old branch is dead anyway.
When it leaves earlier (another branch of the conversation, a subagent sharing the system prompt),
the shared prefix is copied, and the kept sequence stays for its own continuation.

Prefill runs in chunks of `prefill_chunk` tokens, so that a long prompt's attention scores stay
bounded in memory.
"""
from __future__ import annotations

import inspect

import numpy as np
import torch

from server.backend import Prefill, checked_prompt
from server.prefix_store import PrefixStore

_CACHE_KWARGS: dict[type, str] = {}


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x takes `cache=`; older releases `past_key_values=`."""
    cls = type(model)
    if cls not in _CACHE_KWARGS:
        params = inspect.signature(model.forward).parameters
        _CACHE_KWARGS[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARGS[cls]


def _keep_all_sliding_layer():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class KeepAllSlidingLayer(DynamicSlidingWindowLayer):
        """transformers' sliding-window layer that never forgets: a forward still attends to the
        last window of keys (the same tensors, the same mask sizes), but every position stays, so
        cropping to any length is exact."""

        def __init__(self, sliding_window: int, **kwargs):
            super().__init__(sliding_window, **kwargs)
            self.record_past = True

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError("crop takes a negative number of positions to remove")
            if tokens_to_remove == 0 or not self.is_initialized:
                return
            self.keys = self.keys[..., :tokens_to_remove, :]
            self.values = self.values[..., :tokens_to_remove, :]
            self.cumulative_length = self.keys.shape[-2]

    return KeepAllSlidingLayer


_LAYER: list = []


def new_cache(model):
    """A DynamicCache that keeps every position on every layer (see the module docstring)."""
    from transformers import DynamicCache

    if not _LAYER:
        _LAYER.append(_keep_all_sliding_layer())
    cache = DynamicCache(config=model.config)
    cache.layers = [_LAYER[0](layer.sliding_window) if getattr(layer, "is_sliding", False) else layer
                    for layer in cache.layers]
    return cache


def _owning_layers(cache) -> list:
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]


def cache_length(cache) -> int:
    layers = _owning_layers(cache)
    return int(layers[0].keys.shape[-2]) if layers else 0


def cache_bytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in _owning_layers(cache))


def crop(cache, length: int) -> None:
    """Keep the first `length` positions of every layer that owns keys."""
    for layer in _owning_layers(cache):
        drop = layer.keys.shape[-2] - length
        if drop > 0:
            layer.crop(-drop)


def clone_prefix(model, cache, length: int):
    """A new cache holding copies of the first `length` positions."""
    out = new_cache(model)
    for mine, theirs in zip(out.layers, cache.layers):
        if getattr(theirs, "keys", None) is not None and theirs.keys.numel():
            mine.update(theirs.keys[..., :length, :].clone(), theirs.values[..., :length, :].clone())
    return out


def _cropped(cache, length: int):
    crop(cache, length)
    return cache


class EagerBackend:
    supports_tree = False  # transformers' masks are built per layer kind inside the model: chains only

    def __init__(self, model, prefix_budget_bytes: int = 0, max_context: int | None = None,
                 max_step: int = 16, prefill_chunk: int = 2048):
        self.model = model
        self.device = next(model.parameters()).device
        text = model.config.get_text_config()
        self.max_context = int(max_context or text.max_position_embeddings)
        self.max_step = max_step
        self.prefill_chunk = prefill_chunk
        self.store = PrefixStore(prefix_budget_bytes) if prefix_budget_bytes > 0 else None
        self.cache = None
        self.position = 0
        self._keep = False

    # ------------------------------------------------------------ Backend

    def start(self, prompt_ids: list[int], reuse: bool = True) -> Prefill:
        prompt = checked_prompt(prompt_ids, self.max_context)
        self.discard()
        cache, reused = None, 0
        if reuse and self.store is not None:
            cache, reused = self.store.reuse(prompt, _cropped, lambda kv, n: clone_prefix(self.model, kv, n))
        if cache is None:
            cache = new_cache(self.model)
        self.cache, self.position, self._keep = cache, reused, reuse
        logits = None
        for begin in range(reused, len(prompt_ids), self.prefill_chunk):
            logits = self.step(prompt_ids[begin:begin + self.prefill_chunk], keep_last=True)
        return Prefill(logits[-1], reused)

    def step(self, ids: list[int], keep_last: bool = False) -> torch.Tensor:
        """Logits for `ids` appended at the current position ([1, vocab] with keep_last)."""
        x = torch.tensor([ids], device=self.device)
        keep = 1 if keep_last else len(ids)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=keep, **{_cache_kwarg(self.model): self.cache})
        self.position += len(ids)
        return out.logits[0]

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.position:
            raise ValueError(f"cannot roll back {n} of {self.position} positions")
        if n:
            self.position -= n
            crop(self.cache, self.position)

    def finish(self, tokens: np.ndarray, generated: int) -> None:
        cache, keep = self.cache, self._keep
        self.cache, self.position = None, 0
        if cache is None or not keep or self.store is None:
            return
        self.store.keep(tokens, cache, cache_length(cache), cache_bytes(cache), generated)

    def discard(self) -> None:
        self.cache, self.position = None, 0

    def prefix_summary(self) -> dict | None:
        return None if self.store is None else self.store.summary()
