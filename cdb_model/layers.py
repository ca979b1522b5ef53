"""Building blocks shared by Ouro and Huginn: RMSNorm, the two RoPE layouts, the two SwiGLU MLPs.

Tensors are token-major without a batch axis: ``x[N, H]`` holds N tokens of any requests; attention heads are
``[N, heads, head_dim]``. Reduced-precision inputs (bf16) do their norm / RoPE math in float32; float64 stays
float64 (the equivalence tests run in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype for sensitive math: float32, or float64 when the input already is float64."""
    ct = _COMPUTE.get(dtype)
    if ct is None:  # (a plain lookup: promote_types is a dispatcher call, made per layer)
        ct = _COMPUTE[dtype] = torch.promote_types(dtype, torch.float32)
    return ct


_COMPUTE: dict[torch.dtype, torch.dtype] = {}


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``; the normalisation in float32 (or float64), cast back first."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype and x.dtype in _FULL:  # the same math as below, one kernel
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.to(compute_dtype(x.dtype))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


_FULL = (torch.float32, torch.float64)  # dtypes whose norm math needs no up-cast


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin ``[N, head_dim // 2]`` of the angles ``pos * theta^(-2i/head_dim)`` (computed from positions).

    The angles are computed in float32 (float64 for float64 models), like the upstream code.
    """
    ct = compute_dtype(dtype)
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=ct) / head_dim  # [d/2]
    inv_freq = 1.0 / (theta**exponents)  # [d/2]
    angles = positions.to(ct)[:, None] * inv_freq[None, :]  # [N, d/2]
    return angles.cos(), angles.sin()


def half_rotation(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The split-half RoPE factors ``[N, 1, d]`` of ``cos, sin [N, d/2]`` for ``rope_split_half``: cos twice, and
    ``-sin | sin``. Built once per op, used by every layer."""
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def rope_split_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX / Llama "rotate half" RoPE: dimension i pairs with i + d/2. ``x[N, h, d]``, ``cos, sin [N, 1, d]`` from
    ``half_rotation``: ``x1 c - x2 s | x2 c + x1 s`` as ``x * cos + roll(x, d/2) * sin`` (the same floats: the sign
    is in ``sin``)."""
    xf = x if x.dtype == cos.dtype else x.to(cos.dtype)
    out = xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


def pair_rotation(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The interleaved RoPE factors ``[N, 1, d]`` of ``cos, sin [N, d/2]`` for ``rope_interleaved``: each cos twice,
    and ``-sin, sin`` per pair."""
    return (
        torch.stack((cos, cos), dim=-1).flatten(-2)[:, None, :],
        torch.stack((-sin, sin), dim=-1).flatten(-2)[:, None, :],
    )


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Complex-pair RoPE: dimensions (2i, 2i+1) rotate together. ``x[N, h, d]``, ``cos, sin [N, 1, d]`` from
    ``pair_rotation``: ``(a c - b s, b c + a s)`` per pair as ``x * cos + swap_pairs(x) * sin``."""
    xf = x if x.dtype == cos.dtype else x.to(cos.dtype)
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # [N, h, d]: (b, a) per pair
    out = xf * cos + swapped * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


def fuse_linears(*linears: nn.Linear) -> Tensor:
    """One weight ``[sum of outputs, in]`` holding the weights of ``linears`` (bias-free) in order; each layer's
    weight becomes a view into it, so the checkpoint's names and memory stay as they were and one matmul
    computes all of them."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start : start + rows], requires_grad=lin.weight.requires_grad)
        start += rows
    return fused


class OuroMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no bias."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

        self._gate_up: Tensor | None = None

    def fuse(self) -> None:
        """Compute gate and up with one matmul from now on (inference)."""
        self._gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: Tensor) -> Tensor:
        if self._gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self._gate_up).chunk(2, dim=-1)  # [N, I] each
        return self.down_proj(F.silu(gate) * up)


class HuginnMLP(nn.Module):
    """``proj(silu(a) * b)`` with ``[a | b] = fc(x)`` (fc: hidden -> 2 * intermediate), no bias."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.fc(x).chunk(2, dim=-1)  # [N, I] each
        return self.proj(F.silu(a) * b)
