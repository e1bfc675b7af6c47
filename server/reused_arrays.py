"""Large float32 arrays reused from one forward to the next instead of allocated afresh.

Contract: `ReusedArrays(keep, min_bytes, max_bytes)`; `empty(shape)` returns a C-contiguous float32
array of `shape` with undefined contents, as np.empty does. An array of at least `min_bytes` is a
view of a cached buffer that nothing else references any more (its `.base` is that buffer); while
every cached buffer is in use, a new buffer is made and cached if the cache then holds at most `keep`
buffers and `max_bytes` in all, else a plain np.empty that owns its memory is returned. A new buffer
is a quarter larger than asked and as large as the largest cached one, so the cache settles at
buffers of the largest size asked for.
`keep` may be raised later (more users at once). Smaller arrays are plain np.empty. Thread-safe.

Invariant: a buffer is handed out only while no array refers to it. Every view of a numpy array
holds a reference to the array that owns the memory (slices of slices included, and a torch tensor
made from one holds the view), so a buffer whose reference count is back to the cache's own is one no
caller can still read or write. The baseline count is measured, not assumed, since interpreters differ
in how many references a call adds.

Why: each forward's logits (262,144 float32 a row for Gemma: 17 MB for a 17-token verify, 45 MB
for four requests' rows in one forward) were a new array, and a new array's pages are faulted in as
it is first written whenever malloc hands back memory it had returned to the kernel. Measured in
the server with 4 drafted streams of the bundled model (2-core VM, a throwaway log of every forward
with the process's page faults and a `perf record -e page-faults` of the phase): 97% of the phase's
page faults were taken in the matmul kernel (writing its output: the weights are never freed), 500-800
in a faulting forward, and those forwards' LM head call, the one output of that size, ran 15-96 ms
over its usual time.
"""
from __future__ import annotations

import sys
import threading

import numpy as np


def _baseline_refcount() -> int:
    """sys.getrefcount of a cached buffer that nothing else references, read as `_free` reads it."""
    probe = [np.empty(1, dtype=np.float32)]
    return sys.getrefcount(probe[0])


class ReusedArrays:
    def __init__(self, keep: int = 2, min_bytes: int = 4 << 20, max_bytes: int = 512 << 20):
        self.keep, self.min_bytes, self.max_bytes = keep, min_bytes, max_bytes
        self._buffers: list[np.ndarray] = []  # 1-D float32, each the owner of its memory
        self._lock = threading.Lock()
        self._unreferenced = _baseline_refcount()
        self.reused = self.allocated = 0  # arrays handed out from the cache / made for it

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        if size * 4 < self.min_bytes:
            return np.empty(shape, dtype=np.float32)
        with self._lock:
            free = [i for i in range(len(self._buffers)) if self._free(i)]
            fits = [i for i in free if self._buffers[i].shape[0] >= size]
            if fits:
                self.reused += 1
                return self._buffers[fits[0]][:size].reshape(shape)
            # A quarter larger than asked, and as large as the largest cached one: the sizes asked for
            # vary from forward to forward, and each new buffer's pages are faulted in once.
            size_new = max([size + size // 4] + [b.shape[0] for b in self._buffers])
            replaced = free[0] if free else None  # a free buffer too small: the new one takes its place
            kept = sum(b.nbytes for i, b in enumerate(self._buffers) if i != replaced)
            if (free or len(self._buffers) < self.keep) and kept + size_new * 4 <= self.max_bytes:
                self.allocated += 1
                buffer = np.empty(size_new, dtype=np.float32)
                if replaced is not None:
                    self._buffers[replaced] = buffer
                else:
                    self._buffers.append(buffer)
                return buffer[:size].reshape(shape)
            return np.empty(shape, dtype=np.float32)

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) <= self._unreferenced
