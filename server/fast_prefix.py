"""The fast path's prefix cache: the live sequence reused in place, others kept as GPU snapshots.

Contract: `FastPrefixCache(fast, budget_bytes)` works on a `server.fast_path.FastTarget`'s static
cache. `begin(prompt, reuse)` makes the live cache ready for `prompt` and returns the position the
prefill starts at (0..len(prompt)-1); `add_checkpoint` receives the prefill's sliding-window
checkpoints; `note_written(start, ids, span)` records what a forward wrote; `finish(length,
generated)` marks the live sequence as reusable; `discard()` forgets it; `summary()` reports.

Exactness. Full-attention layers hold slot = position, so any prefix of them is exact. Sliding
layers hold a ring of `window + chunk` slots; resuming at position p needs the keys of positions
p-window+1..p-1 in the ring, which holds iff nothing at or past p + chunk - ... overwrote them:
p >= max_written - chunk, where `max_written` is one past the highest position any forward wrote
(padding and rejected drafts included). For a prompt that leaves the sequence earlier, the prefill
kept checkpoints: every `checkpoint_every` positions c, the sliding layers' K/V of c-window..c-1
(E4B: 20 MiB each). They count against the store's budget (`PrefixStore.hold`) from the moment
they are made, so a long prompt under a memory cap cannot outgrow the plan with them; one that
does not fit is not made (whole: every layer's or none), and a resume falls back to an earlier one.
Resuming restores the latest checkpoint c <= p into the ring and recomputes c..p (fewer than
`checkpoint_every` tokens), so the result is exact either way; never a stale or missing key.
Entries of the ring or of the full layers at positions >= the resume point are stale but harmless:
masks hide positions past each query, and the forward writes a position before any query reads it.

Where sequences live. The most recent one is the live cache itself (reusing it copies nothing).
Others are `KeptSequence`s in a `PrefixStore` under `budget_bytes` of GPU memory: copies of the
full layers' first L positions, the ring, its positions and the checkpoints (checkpoint tensors are
never written after creation, so a snapshot and the live cache share them). A prompt that matches
a snapshot better than the live sequence swaps them: the live one is snapshotted first, then the
snapshot copied in (device-to-device; on E4B about 16 KB per position).
"""
from __future__ import annotations

import numpy as np
import torch

from server.prefix_store import KeptSequence, PrefixStore, common_prefix

DEFAULT_CHECKPOINT_EVERY = 4096


class FastPrefixCache:
    def __init__(self, fast, budget_bytes: int, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
                 store: PrefixStore | None = None):
        self.fast = fast
        # `store`: kept sequences shared with other lanes over the same model (server/fast_batch.py;
        # their caches have the same layout), else a store of this cache's own when budget_bytes > 0.
        self.store = store if store is not None else (PrefixStore(budget_bytes) if budget_bytes > 0 else None)
        self.enabled = self.store is not None
        self.checkpoint_every = checkpoint_every
        self.tokens = np.zeros(fast.max_len + fast.max_bucket, dtype=np.int32)  # id at each position
        self.live_len = 0          # the live sequence: positions 0..live_len-1 of the cache
        self.live_generated = 0
        self.live_valid = False
        self.max_written = 0
        self.checkpoints: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.refused_checkpoints: set[int] = set()  # this prefill's positions whose checkpoint did not fit
        self.making_checkpoints = False

    # ------------------------------------------------------------ the request cycle

    def begin(self, prompt: np.ndarray, reuse: bool) -> int:
        self.refused_checkpoints = set()
        # a sequence that will not be kept makes no checkpoints (they would evict kept sequences)
        self.making_checkpoints = reuse and self.enabled
        if not (reuse and self.enabled):
            self._stash_live()  # measurements and no-reuse requests must not destroy a kept sequence
            self.reset()
            return 0
        live_shared = self._live_shared(prompt)
        with self.store.lock:  # a store shared by lanes: no other lane takes the entry between best and pop
            entry, shared = self.store.best(prompt)
            if entry is not None and shared > live_shared:
                self.store.pop(entry)  # first: stashing the live sequence may evict to make room
                self._stash_live()
                self._restore(entry)
                live_shared = shared
            elif self.live_valid and live_shared < self.live_len - self.live_generated:
                self._stash_live()  # the prompt leaves it inside its prompt: another branch, keep a copy
            start = self._resume(min(live_shared, len(prompt) - 1))
            self.store.record(start, len(prompt) - start)
        self.live_valid = False  # until finish: the live cache is being rewritten
        return start

    def note_written(self, start: int, ids, span: int) -> None:
        """A forward wrote `ids` at start.. (and padding up to start + span)."""
        self.tokens[start:start + len(ids)] = ids
        self.max_written = max(self.max_written, start + span)

    def add_checkpoint(self, c: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.making_checkpoints or c in self.refused_checkpoints:
            return
        if c not in self.checkpoints:  # its first layer: the whole checkpoint is admitted or refused
            if not self.store.hold(self, self._checkpoint_bytes(k.shape[1])):
                self.refused_checkpoints.add(c)
                return
        self.checkpoints.setdefault(c, {})[layer] = (k.clone(), v.clone())

    def _checkpoint_bytes(self, positions: int) -> int:
        """One checkpoint of `positions` keys: every sliding source layer's K and V."""
        fast = self.fast
        return positions * sum(2 * kc.shape[0] * kc.shape[2] * kc.element_size()
                               for i, kc in fast.k_cache.items() if fast.layers[i].sliding)

    def _set_checkpoints(self, checkpoints: dict) -> None:
        """Replace the live checkpoints; the store counts what they hold now."""
        self.checkpoints = checkpoints
        if self.store is not None:
            self.store.set_held(self, _ckpt_bytes(checkpoints))

    def finish(self, length: int, generated: int, keep: bool) -> None:
        self.live_len, self.live_generated = length, generated
        self.live_valid = keep and self.enabled and length > 0

    def live_match(self, prompt) -> int:
        """How many of the prompt's first tokens the live sequence holds, counted only when the
        prompt continues it past its own prompt (an agent's next turn: resumed in place); 0 when
        it leaves it earlier (a shared system prompt, another conversation), which would move the
        live sequence to the store first, or when nothing is reusable."""
        n = self._live_shared(np.asarray(prompt, dtype=np.int32))
        return n if n >= self.live_len - self.live_generated else 0

    def _live_shared(self, prompt: np.ndarray) -> int:
        """The prompt's common prefix with the live sequence (0 when it is not reusable)."""
        return common_prefix(self.tokens[:self.live_len], prompt) if self.live_valid else 0

    def discard(self) -> None:
        self.live_valid = False

    def reset(self) -> None:
        """Forget the live sequence: every ring slot invisible, no checkpoints."""
        self.fast.slot_pos.fill_(-1)
        self._set_checkpoints({})
        self.max_written = 0
        self.live_len = self.live_generated = 0
        self.live_valid = False

    def summary(self) -> dict | None:
        if not self.enabled:
            return None
        out = self.store.summary()
        out["live_tokens"] = self.live_len if self.live_valid else 0
        out["live_checkpoint_bytes"] = _ckpt_bytes(self.checkpoints)
        return out

    # ------------------------------------------------------------ resuming

    def _resume(self, p: int) -> int:
        fast = self.fast
        if p <= 0:
            self.reset()
            return 0
        if p >= self.max_written - fast.chunk:
            self._set_checkpoints({c: v for c, v in self.checkpoints.items() if c <= p})
            return p
        c = max((c for c in self.checkpoints if c <= p), default=0)
        if c == 0:
            self.reset()
            return 0
        for layer, (k, v) in self.checkpoints[c].items():
            positions = torch.arange(c - k.shape[1], c, device=fast.device)
            slots = positions % fast.ring
            fast.k_cache[layer].index_copy_(1, slots, k)
            fast.v_cache[layer].index_copy_(1, slots, v)
        positions = torch.arange(max(0, c - fast.window), c, device=fast.device)
        fast.slot_pos.index_copy_(0, positions % fast.ring, positions)
        self._set_checkpoints({k: v for k, v in self.checkpoints.items() if k <= c})
        self.max_written = c
        return c

    # ------------------------------------------------------------ snapshots

    def _stash_live(self) -> None:
        """Keep a copy of the live sequence in the store (when it is valid and fits)."""
        if not (self.enabled and self.live_valid and self.live_len > 0):
            return
        fast, n = self.fast, self.live_len
        full = [i for i in fast.k_cache if not fast.layers[i].sliding]
        ring = [i for i in fast.k_cache if fast.layers[i].sliding]
        per_pos = sum(fast.k_cache[i][:, :1].numel() * fast.k_cache[i].element_size() * 2 for i in full)
        ring_bytes = sum(fast.k_cache[i].numel() * fast.k_cache[i].element_size() * 2 for i in ring)
        nbytes = per_pos * n + ring_bytes + _ckpt_bytes(self.checkpoints)
        if nbytes > self.store.budget:
            return
        try:
            kv = {"full": {i: (fast.k_cache[i][:, :n].clone(), fast.v_cache[i][:, :n].clone()) for i in full},
                  "ring": {i: (fast.k_cache[i].clone(), fast.v_cache[i].clone()) for i in ring},
                  "slot_pos": fast.slot_pos.clone(), "max_written": self.max_written,
                  "checkpoints": dict(self.checkpoints)}
        except torch.OutOfMemoryError:
            return  # no room for a copy now: the sequence is simply not kept
        with self.store.lock:  # lanes share the store (server/fast_batch.py)
            # The checkpoints pass to the kept sequence, which counts them; what the live cache keeps
            # of them after this (a resume inside the sequence) is counted again: on the safe side.
            self.store.set_held(self, 0)
            self.store.put(KeptSequence(self.tokens[:n].copy(), kv, nbytes, self.live_generated))

    def _restore(self, entry: KeptSequence) -> None:
        fast, kv, n = self.fast, entry.kv, len(entry.tokens)
        for i, (k, v) in kv["full"].items():
            fast.k_cache[i][:, :n].copy_(k)
            fast.v_cache[i][:, :n].copy_(v)
        for i, (k, v) in kv["ring"].items():
            fast.k_cache[i].copy_(k)
            fast.v_cache[i].copy_(v)
        fast.slot_pos.copy_(kv["slot_pos"])
        self.max_written = kv["max_written"]
        self._set_checkpoints(dict(kv["checkpoints"]))
        self.tokens[:n] = entry.tokens
        self.live_len, self.live_generated, self.live_valid = n, entry.generated, True


def _ckpt_bytes(checkpoints: dict) -> int:
    return sum(t.numel() * t.element_size() for layers in checkpoints.values() for kv in layers.values() for t in kv)
