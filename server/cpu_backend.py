"""The CPU int8 backend: server/backend.py's `Backend` over server/cpu_model.py's CpuGemma (Gemma 3 and 4).

Contract: `CpuBackend(cpu_model, max_context, prefix_budget_bytes, max_step)`. The live sequence's
keys and values sit in a KVCache that grows by doubling (a step writes positions in place; rolling
back only moves `position`, the rows past it are overwritten by the next step). Prefill runs in
chunks of `prefill_chunk` tokens. Every forward is batch-invariant (see cpu_model), so a verify
step's logits equal the one-token steps', and drafted output equals plain output bit for bit.

Several requests at once: `lanes(n)` gives n backends over one model and one prefix store whose
forwards a StepBatcher (server/batcher.py) runs together; each lane's logits stay bit for bit its own.

Prefix reuse, as the eager backend does it: finished sequences are kept in a PrefixStore under
`prefix_budget_bytes` (0: off). A new prompt reuses the kept sequence with the longest common prefix,
up to all but its last token; when it leaves that sequence inside its generated reply or past it (an
agent's next turn), the kept cache is taken over with no copy; otherwise the shared prefix is copied.
"""
from __future__ import annotations

import numpy as np
import torch

from server.backend import Prefill, checked_prompt
from server.batcher import StepBatcher
from server.cpu_model import CpuGemma, KVCache, Rows
from server.prefix_store import PrefixStore

_FIRST_CAPACITY = 1024
SHARED_PREFILL_CHUNK = 64  # prefill chunk while other requests share the forwards (about 60 ms on 2 cores)


class CpuBackend:
    supports_tree = True  # step(ids, parents=...) and keep_path (server/backend.py)

    def __init__(self, model: CpuGemma, max_context: int, prefix_budget_bytes: int = 0, max_step: int = 17,
                 prefill_chunk: int = 256, store: PrefixStore | None = None, batcher: StepBatcher | None = None):
        self.model = model
        self.max_context = int(max_context)
        self.max_step = max_step
        self.prefill_chunk = prefill_chunk
        self.store = store if store is not None else (PrefixStore(prefix_budget_bytes) if prefix_budget_bytes > 0 else None)
        self.batcher = batcher  # None: this backend's forwards run alone
        self.cache: KVCache | None = None
        self.position = 0
        self._keep = False
        self._joined = False  # a member of the batcher's forwards (between start and finish/discard)
        self._others = (0, 0)  # the other lanes' load on the last forward (shared_load)
        self._tree_start = -1  # where the last step began, when it was a tree

    def lanes(self, n: int) -> list["CpuBackend"]:
        """n backends for n requests at once (this one first): one model, one prefix store, and one
        StepBatcher (server/batcher.py) that runs their steps together, each bit for bit as alone."""
        if n <= 1:
            return [self]
        self.batcher = self.batcher or StepBatcher(self.model)
        # Each lane holds its last forward's logits (a view of a reused buffer: server/reused_arrays.py)
        # while its next forward runs, so n lanes need n + 1 buffers to find a free one every forward.
        self.model.logits_buffers.keep = max(self.model.logits_buffers.keep, n + 1)
        return [self] + [CpuBackend(self.model, self.max_context, 0, self.max_step, self.prefill_chunk,
                                    store=self.store, batcher=self.batcher) for _ in range(n - 1)]

    def start(self, prompt_ids: list[int], reuse: bool = True) -> Prefill:
        prompt = checked_prompt(prompt_ids, self.max_context)
        self.discard()
        cache, reused = None, 0
        if reuse and self.store is not None:  # a taken-over cache needs no trim: steps overwrite past `reused`
            cache, reused = self.store.reuse(prompt, lambda kv, n: kv, self._copy_prefix)
        self.cache = cache if cache is not None else self.model.new_cache(_FIRST_CAPACITY)
        self.position, self._keep = reused, reuse
        if self.batcher is not None:
            self.batcher.join()
            self._joined = True
        logits, begin = None, reused
        while begin < len(prompt_ids):
            # Beside other running requests a chunk is short: each of their steps waits for it.
            chunk = self.prefill_chunk if not self._joined or self.batcher.members <= 1 else SHARED_PREFILL_CHUNK
            logits = self.step(prompt_ids[begin:begin + chunk], last_only=True)
            begin += chunk
        return Prefill(logits[-1], reused)

    def step(self, ids: list[int], last_only: bool = False, parents=None) -> torch.Tensor:
        n = len(ids)
        self._reserve(self.position + n)
        rows = Rows(ids, self.position, self.cache, last_only, parents)
        if self._joined:
            logits, self._others = self.batcher.run(rows)
        else:
            logits = self.model.forward_batch([rows])[0]
        self.position += n
        self._tree_start = self.position - n if parents is not None else -1
        return torch.from_numpy(logits)

    def shared_load(self) -> tuple[int, int]:
        """(requests, rows) that shared this lane's last forward besides it (0, 0 when alone)."""
        return self._others if self._joined else (0, 0)

    def keep_path(self, path: list[int]) -> None:
        """After a tree step (server/backend.py): keep its rows `path`, a root path, at the positions
        of a chain; the rest is forgotten."""
        start = self._tree_start
        if start < 0:
            raise ValueError("keep_path follows a tree step")
        self._tree_start = -1
        self.cache.keep_path(start, list(path))
        self.position = start + len(path)

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.position:
            raise ValueError(f"cannot roll back {n} of {self.position} positions")
        self.position -= n

    def finish(self, tokens: np.ndarray, generated: int) -> None:
        cache, keep, length = self.cache, self._keep, self.position
        self.discard()
        if cache is None or not keep or self.store is None:
            return
        self.store.keep(tokens, cache, length, cache.nbytes(), generated)

    def discard(self) -> None:
        self.cache, self.position = None, 0
        if self._joined:
            self._joined = False
            self.batcher.leave()

    def prefix_summary(self) -> dict | None:
        return None if self.store is None else self.store.summary()

    def _reserve(self, length: int) -> None:
        """Grow the live cache (doubling) to hold `length` positions."""
        if length > self.max_context + self.max_step:
            raise ValueError(f"{length} positions exceed the context of {self.max_context}")
        cache = self.cache
        if length <= cache.max_len:
            return
        capacity = cache.max_len
        while capacity < length:
            capacity *= 2
        self.cache = cache.copy_prefix(self.position, capacity)

    def _copy_prefix(self, cache: KVCache, length: int) -> KVCache:
        capacity = _FIRST_CAPACITY
        while capacity < length + 1:
            capacity *= 2
        return cache.copy_prefix(length, capacity)

