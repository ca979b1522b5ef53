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
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``; the normalisation in float32 (or float64), cast back first."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(compute_dtype(x.dtype))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin ``[N, head_dim // 2]`` of the angles ``pos * theta^(-2i/head_dim)`` (computed from positions).

    The angles are computed in float32 (float64 for float64 models), like the upstream code.
    """
    ct = compute_dtype(dtype)
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=ct) / head_dim  # [d/2]
    inv_freq = 1.0 / (theta**exponents)  # [d/2]
    angles = positions.to(ct)[:, None] * inv_freq[None, :]  # [N, d/2]
    return angles.cos(), angles.sin()


def rope_split_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX / Llama "rotate half" RoPE: dimension i pairs with i + d/2. ``x[N, h, d]``, cos/sin ``[N, d/2]``."""
    half = x.shape[-1] // 2
    xf = x.to(cos.dtype)
    x1, x2 = xf[..., :half], xf[..., half:]  # [N, h, d/2] each
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, d/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Complex-pair RoPE: dimensions (2i, 2i+1) rotate together. ``x[N, h, d]``, cos/sin ``[N, d/2]``."""
    xf = x.to(cos.dtype).unflatten(-1, (-1, 2))  # [N, h, d/2, 2]
    a, b = xf[..., 0], xf[..., 1]  # [N, h, d/2] each
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, d/2]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)  # [N, h, d]


class OuroMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no bias."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HuginnMLP(nn.Module):
    """``proj(silu(a) * b)`` with ``[a | b] = fc(x)`` (fc: hidden -> 2 * intermediate), no bias."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.fc(x).chunk(2, dim=-1)  # [N, I] each
        return self.proj(F.silu(a) * b)
