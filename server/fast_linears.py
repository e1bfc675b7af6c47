"""The fast path's linear layers: what `FastTarget` calls a model's nn.Linear weights through.

Contract: `as_linear(module)` gives the fast equivalent of a bias-free (possibly optimum-quanto
quantized) nn.Linear: `Int4Linear` (quanto's tinygemm-packed int4, shared, not copied),
`ReleasedLinear` (columns of the step kernels' int4 layout, after `release_module` freed the quanto
tensors on the GPU) or `DenseLinear` (a plain weight, or another quanto layout dequantized once).
Each is callable on x [..., in_features] and says its `nbytes()`. `fuse_int4(parts)` concatenates
tinygemm int4 linears into one matmul (q|k|v, gate|up), checked once against the separate ones;
`released_parts(parts)` gives the stored step layout back when released parts cover it in order.
The step kernels' own layout is server/small_m_matmul.py's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

class Int4Linear:
    """y = x @ W^T with W held as quanto's tinygemm-packed int4 (shared, not copied)."""

    def __init__(self, packed: torch.Tensor, scale_shift: torch.Tensor, group_size: int, out_features: int):
        self.packed, self.scale_shift, self.group_size, self.out_features = packed, scale_shift, group_size, out_features
        self.mm = torch._weight_int4pack_mm_for_cpu if packed.device.type == "cpu" else torch._weight_int4pack_mm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mm(x.reshape(-1, x.shape[-1]), self.packed, self.group_size, self.scale_shift)
        return y.reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scale_shift.numel() * self.scale_shift.element_size()


class ReleasedLinear:
    """A linear whose quanto tensors were released from the GPU: its weight is columns lo:hi of a
    step-kernel int4 layout `layout` = (qweight, scale, offset, n, k) (server/small_m_matmul.py),
    the q|k|v or gate|up concatenation it is part of or its own. Kept on the HF module as
    `_sailfish_released` (see `as_linear`). Calling it (paths without step kernels) dequantizes
    the layout for one cuBLAS GEMM: correct for any rows, not a fast path."""

    def __init__(self, layout: tuple, lo: int, hi: int):
        self.layout, self.lo, self.hi = layout, lo, hi
        self.out_features = hi - lo
        self.in_features = layout[4]

    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.layout[3]

    def step_layout(self):
        """A SmallMLinear over these columns: the stored tensors themselves when they are this
        linear's alone, else a contiguous copy of the columns."""
        from server.small_m_matmul import SmallMLinear
        w, scale, offset, n, k = self.layout
        if self.whole():
            return SmallMLinear(w, scale, offset, n, k)
        cols = slice(self.lo, self.hi)
        return SmallMLinear(w[:, cols].contiguous(), scale[:, cols].contiguous(), offset[:, cols].contiguous(),
                            self.hi - self.lo, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from server.small_m_matmul import SmallMLinear
        w, scale, offset, n, k = self.layout
        wt = SmallMLinear(w, scale, offset, n, k).dequantize_t()[:, self.lo:self.hi]
        return x @ wt

    def nbytes(self) -> int:
        w, scale, offset, n, k = self.layout
        return (w.numel() * 4 + (scale.numel() + offset.numel()) * scale.element_size()) * self.out_features // n


def released_parts(parts: list):
    """A SmallMLinear over the stored layout when `parts` are all ReleasedLinear columns of one
    layout, in order, covering it (a second FastTarget's q|k|v or gate|up: no copy), else None."""
    if not parts or not all(isinstance(p, ReleasedLinear) for p in parts):
        return None
    if len({id(p.layout[0]) for p in parts}) != 1:
        return None
    at = 0
    for p in parts:
        if p.lo != at:
            return None
        at = p.hi
    if at != parts[0].layout[3]:
        return None
    from server.small_m_matmul import SmallMLinear
    return SmallMLinear(*parts[0].layout)


def release_module(module: torch.nn.Module, small, lo: int, hi: int) -> ReleasedLinear:
    """Free a quanto linear's packed tensors on the GPU: its weight becomes a meta-device
    placeholder of the same shape, and the module keeps columns lo:hi of `small`'s layout."""
    layout = (small.weight, small.scale, small.offset, small.n, small.k)
    module._sailfish_released = (layout, lo, hi)
    shape = tuple(module.weight.shape)
    module.weight = torch.nn.Parameter(torch.empty(shape, dtype=small.scale.dtype, device="meta"), requires_grad=False)
    return ReleasedLinear(layout, lo, hi)


class DenseLinear:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def fuse_int4(parts: list) -> Int4Linear | None:
    """One Int4Linear computing [p(x) for p in parts] concatenated (one matmul instead of several),
    or None when they are not all tinygemm int4 of one group size. tinygemm packs 8 output rows per
    tile (packed [N/8, ...]) and keeps scales as [K/group, N, 2], so concatenating both along N is
    the packing of the stacked weight. Costs a copy of these weights (the model keeps its own)."""
    if not all(isinstance(p, Int4Linear) for p in parts) or len({p.group_size for p in parts}) != 1:
        return None
    if any(p.out_features % 8 for p in parts):
        return None
    packed = torch.cat([p.packed for p in parts], 0)
    scale_shift = torch.cat([p.scale_shift for p in parts], 1).contiguous()
    fused = Int4Linear(packed, scale_shift, parts[0].group_size, sum(p.out_features for p in parts))
    # Self-check on one random input: the fused product must equal the separate ones.
    x = torch.randn(2, scale_shift.shape[0] * parts[0].group_size, dtype=scale_shift.dtype, device=packed.device)
    want = torch.cat([p(x) for p in parts], -1).float()
    if ((fused(x).float() - want).norm() / want.norm()).item() > 1e-3:
        return None
    return fused


def as_linear(module: torch.nn.Linear):
    """The fast equivalent of a (possibly quanto-quantized) bias-free nn.Linear."""
    if getattr(module, "bias", None) is not None:
        raise ValueError("biased linear layers are not supported (Gemma 4 has none)")
    released = getattr(module, "_sailfish_released", None)
    if released is not None:  # an earlier FastTarget moved its weights into the step kernels' layout
        return ReleasedLinear(*released)
    weight = module.weight
    if hasattr(module, "qweight") and module.qweight is not None:
        weight = module.qweight
    if type(weight).__name__ == "TinyGemmWeightQBitsTensor":
        return Int4Linear(weight._data._data, weight._scale_shift, weight._group_size, weight.shape[0])
    if isinstance(weight, torch.Tensor) and type(weight) in (torch.Tensor, torch.nn.Parameter):
        return DenseLinear(weight.data)
    # Other quanto layouts (int8, CPU fp32 int4): dequantize once. Correct, but not int4 speed.
    return DenseLinear(weight.dequantize().contiguous())
