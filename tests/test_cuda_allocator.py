"""server.cuda_allocator: the server turns on expandable segments unless the user set
PYTORCH_CUDA_ALLOC_CONF, and does nothing off CUDA. The call into PyTorch is recorded, not made
(CI has no GPU; the CUDA tests and bench.gpu_memory make it on one), and it exists in this torch."""
from __future__ import annotations

import torch

from server import cuda_allocator


def _record(monkeypatch, cuda: bool) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(cuda_allocator, "_apply_allocator_settings", calls.append)
    return calls


def test_expandable_segments_by_default(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    calls = _record(monkeypatch, cuda=True)
    notes: list[str] = []
    assert cuda_allocator.configure_cuda_allocator(notes) == "expandable_segments:True"
    assert calls == ["expandable_segments:True"] and "expandable_segments:True" in notes[0]


def test_the_users_setting_stands(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    calls = _record(monkeypatch, cuda=True)
    notes: list[str] = []
    assert cuda_allocator.configure_cuda_allocator(notes) == "max_split_size_mb:128"
    assert calls == [] and "yours" in notes[0]


def test_nothing_off_cuda(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    calls = _record(monkeypatch, cuda=False)
    assert cuda_allocator.configure_cuda_allocator([]) == "" and calls == []


def test_the_default_allocator_for_an_ab(monkeypatch):
    """bench.gpu_memory --allocator default: an empty setting changes nothing."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    calls = _record(monkeypatch, cuda=True)
    assert cuda_allocator.configure_cuda_allocator([], setting="") == "" and calls == []


def test_pytorch_has_the_runtime_setting():
    assert callable(getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                    or getattr(torch.cuda.memory, "_set_allocator_settings", None))
