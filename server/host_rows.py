"""Embedding tables kept in host memory, looked up a few rows at a time, bit for bit the module's rows.

Contract: `HostRowTable(module, device, mapped=None)` moves an embedding module's weight to the host
(the fast path owns the model while it serves) and gives exactly what the module's forward gives:
the rows times the module's embed_scale, rounded to the table's dtype (transformers'
Gemma4TextScaledWordEmbedding), on `device`. Gemma 4's per-layer embeddings (E4B: 262,144 x 10,752
bf16, 5.25 GiB) and, under a memory cap, the token embedding are lookups of a few rows a token,
not matmuls, so these tables need not take GPU memory. Two ways to look them up:

- mapped (`table.mapped`; CUDA): the table's pages are locked and mapped into the GPU's address
  space (cuMemHostRegister), and `table(ids)` with ids on the GPU gathers the rows in one kernel
  (server/gpu_kernels.py `_gather_rows`) that reads host memory in place over PCIe: 21 KB a token
  for E4B's per-layer rows. The kernel is captured in the step's CUDA graph like any other, so a
  step's inputs need no host work but its ids and positions.
- staged (elsewhere, or where mapping is refused or its check fails; `table.note` says why): the
  rows are gathered on the host and copied. `rows_into(host_ids, out)` writes a step's rows into
  its GPU buffer before the graph's replay (a host gather, a blocking copy and a multiply per step);
  `table(ids)` gathers for a prefill.

`mapped=None` maps where it can; True insists (an error if it cannot: tests run the kernel on the
CPU under Triton's interpreter this way); False stages. A mapped table is checked once when
built: its kernel's rows for a few ids must equal the staged rows, or the table stages.
Registrations are counted per address, so the lanes' tables over one module share one; the last
table to go unregisters it.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import weakref

import torch

log = logging.getLogger("sailfish.host_rows")

# cuMemHostRegister flags: pinned for every context, and mapped into the device address space
_PORTABLE, _DEVICEMAP = 0x01, 0x02
_BLOCK = 1024  # columns a program of the gather: one 16-byte load a thread (4 warps, bf16)

_registered: dict[int, int] = {}  # host address -> tables mapping it
# Reentrant: a table's finalizer (_unregister) runs wherever a garbage collection happens, which
# may be inside _register on this very thread (FastTargets sit in reference cycles).
_registry_lock = threading.RLock()


def embed_scale(module, dtype: torch.dtype) -> torch.Tensor | None:
    """An embedding module's `embed_scale` as the module applies it: a scalar of `dtype` (the rows'
    dtype), on the host; None for a module without one."""
    scale = getattr(module, "embed_scale", None)
    return None if scale is None else torch.as_tensor(scale).to(device="cpu", dtype=dtype)


class HostRowTable:
    def __init__(self, module, device: torch.device, mapped: bool | None = None):
        module.to("cpu")
        self.weight = module.weight.detach()
        scale = embed_scale(module, self.weight.dtype)  # (on the host)
        self.scale = None if scale is None else scale.to(device)
        # the kernel's scale, read once here: reading a GPU tensor inside a graph's capture would sync
        self._scale_value = None if scale is None else float(scale)
        self.width, self.dtype, self.device = self.weight.shape[1], self.weight.dtype, device
        pin = device.type == "cuda"
        self._staging = torch.empty(0, self.width, dtype=self.dtype, pin_memory=pin)
        self._pin = pin
        self.mapped = False
        self.note = "staged: gathered on the host, then copied"
        if mapped is False:
            self.note += " (not mapped: asked to stage)"
            return
        why_not = self._map(insist=bool(mapped))
        if why_not is not None and mapped:
            raise RuntimeError(f"the host table cannot be mapped: {why_not}")
        if why_not is not None:
            self.note += f" ({why_not})"

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gather(ids.to(self.device)) if self.mapped else self.staged(ids)

    def staged(self, ids: torch.Tensor) -> torch.Tensor:
        """The staged lookup of `ids` (any device): gathered on the host, scaled on the device."""
        rows = self.weight.index_select(0, ids.to("cpu")).to(self.device)
        return rows * self.scale if self.scale is not None else rows

    def rows_into(self, host_ids: torch.Tensor, out: torch.Tensor) -> None:
        """The staged lookup of a step: `host_ids`' rows into `out` (on the device)."""
        n = host_ids.shape[0]
        if self._staging.shape[0] < n:
            self._staging = torch.empty(n, self.width, dtype=self.dtype, pin_memory=self._pin)
        torch.index_select(self.weight, 0, host_ids, out=self._staging[:n])
        out.copy_(self._staging[:n])  # blocking: the next step rewrites the staging rows
        if self.scale is not None:
            out.mul_(self.scale)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The mapped lookup: the rows of `ids` (on the device), read from host memory by one kernel."""
        return gather_rows(self.weight, ids, self.device, self._scale_value)

    def _map(self, insist: bool) -> str | None:
        """Map the table for the GPU (None), or say why not (the table stays staged). Under Triton's
        interpreter a CPU table asked to map runs the gather kernel on the host (tests)."""
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if self.device.type != "cuda" and not (interpreted and insist):
            return "no GPU to map it for"
        if not self.weight.is_contiguous():
            return "the table is not contiguous"
        release = None
        if self.device.type == "cuda":
            address = self.weight.data_ptr()
            why_not = _register(address, self.weight.numel() * self.weight.element_size(), self.device)
            if why_not is not None:
                return why_not
            # The finalizer holds the table's memory until it is unregistered; at exit the driver
            # releases everything (lanes' threads may still be replaying then).
            release = weakref.finalize(self, _unregister, address, self.weight, self.device)
            release.atexit = False
        self.mapped = True
        ids = torch.tensor(sorted({0, self.weight.shape[0] // 2, self.weight.shape[0] - 1}), device=self.device)
        try:
            ok = torch.equal(self.gather(ids), self.staged(ids))
        except Exception as e:  # e.g. a driver that will not give the kernel a device address for it
            ok, why = False, f"the GPU could not read it in place: {type(e).__name__}: {e}"
        else:
            why = "its rows read in place differed from the host's"
        if not ok:
            self.mapped = False
            if release is not None:
                release()
            return why
        self.note = "mapped: read in place by the GPU, inside the step's graph"
        return None


@functools.lru_cache(maxsize=1)
def _driver():
    """libcuda through ctypes: the driver API reports a failed registration in its return value
    only, where the runtime's cudaHostRegister would also leave it as the thread's last error for
    the next kernel launch to raise."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    return lib


def gather_rows(table: torch.Tensor, ids: torch.Tensor, device: torch.device, scale: float | None = None) -> torch.Tensor:
    """table[ids] (times `scale`, rounded as torch rounds a bf16 tensor times a bf16 scalar) in one
    launch of server/gpu_kernels.py `_gather_rows`: a table on the device, or a host table mapped
    for it (HostRowTable), ids on `device`. Rows are read 16 bytes a thread, so a captured step's
    lookups (the RoPE tables' rows: FastTarget.rope_rows) are one short kernel."""
    from server.gpu_kernels import _gather_rows

    ids = ids.contiguous()  # (every caller's are: the kernel reads ids[r] at r)
    width = table.shape[1]
    out = torch.empty(ids.shape[0], width, dtype=table.dtype, device=device)
    if ids.shape[0]:
        _gather_rows[(ids.shape[0], -(-width // _BLOCK))](
            table, ids, out, 1.0 if scale is None else scale, width, table.shape[0], table.stride(0), out.stride(0),
            HAS_SCALE=scale is not None, BLOCK=_BLOCK, num_warps=4)
    return out


def _register(address: int, nbytes: int, device: torch.device) -> str | None:
    with _registry_lock:
        _drain()
        if address in _registered:
            _registered[address] += 1
            return None
        try:
            torch.cuda.synchronize(device)  # the runtime's primary context is current on this thread
            result = _driver().cuMemHostRegister_v2(address, nbytes, _PORTABLE | _DEVICEMAP)
        except OSError as e:
            return f"no CUDA driver library to map it with ({e})"
        if result != 0:
            return f"cuMemHostRegister refused {nbytes / 2**30:.2f} GiB (CUresult {result})"
        _registered[address] = 1
        return None


def _unregister(address: int, weight: torch.Tensor, device: torch.device) -> None:
    """The last table over `address` is gone: unregister it once no kernel can still read it.
    (`weight` keeps the memory alive until then.) A finalizer runs on whatever thread collects the
    table: inside a graph's capture it defers to the next registration, since neither a sync nor a
    driver call may run there."""
    with _registry_lock:
        _registered[address] -= 1
        if _registered[address] > 0:
            return
        del _registered[address]
        if torch.cuda.is_current_stream_capturing():
            _deferred.append((address, weight, device))
            return
        _release(address, device)
        _drain()


def _drain() -> None:
    """The unregistrations a capture put off (outside a capture)."""
    while _deferred and not torch.cuda.is_current_stream_capturing():
        address, _, device = _deferred.pop()
        _release(address, device)


def _release(address: int, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # kernels that read the table have ended; its context is current
    result = _driver().cuMemHostUnregister(address)
    if result != 0:
        log.warning("cuMemHostUnregister of a host table failed (CUresult %d): its pages stay locked", result)


_deferred: list[tuple[int, torch.Tensor, torch.device]] = []  # unregistrations a capture put off
