"""Regression read-out: statistics of the 999 predicted quantiles (reference ``predict_stats``).

The raw outputs are quantiles at levels ``i / (Q + 1)``, ``i = 1..Q``. They are sorted (fixes
crossing); ``mean`` / ``variance`` are plain moments of the sorted values; ``median`` and
``quantiles`` use the inverse CDF: linear interpolation between knots inside the level range and
exponential tails outside (slopes fitted on the 20 extreme quantiles of each side).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

#: Output types understood by :func:`quantile_stats`.
OUTPUT_TYPES = ("mean", "variance", "median", "quantiles", "raw_quantiles")
#: Default probability levels for ``output_type="quantiles"``.
DEFAULT_ALPHAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

_TOL = 1e-6
_MIN_BETA, _MAX_BETA = 0.01, 100.0
_TAIL_QUANTILES = 20


def quantile_levels(num_quantiles: int, like: Tensor) -> Tensor:
    """Levels ``linspace(0, 1, Q + 2)[1:-1]`` (computed in fp32 on CPU as the reference does)."""
    return torch.linspace(0.0, 1.0, num_quantiles + 2)[1:-1].to(like.device, like.dtype)


def _tail_slope(values: Tensor, log_levels: Tensor) -> Tensor:
    """|least-squares slope| of ``values (..., k)`` against ``log_levels (k,)``, clamped."""
    x = log_levels - log_levels.mean()
    y = values - values.mean(dim=-1, keepdim=True)
    slope = (y * x).mean(dim=-1) / (x**2).mean().clamp(min=_TOL)
    return slope.abs().clamp(min=_MIN_BETA, max=_MAX_BETA)


def _tails(q: Tensor, levels: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Coefficients ``(a_l, b_l, a_r, b_r)``: left ``a_l ln(a) + b_l``, right ``a_r ln(1-a) + b_r``."""
    k = min(_TAIL_QUANTILES, q.shape[-1] // 4)
    beta_l = _tail_slope(q[..., :k], torch.log(levels[:k].clamp(min=_TOL)))
    beta_r = _tail_slope(q[..., -k:], torch.log((1 - levels[-k:]).clamp(min=_TOL)))
    alpha_l, alpha_r = levels[0].item(), levels[-1].item()
    log_l = torch.log(torch.tensor(max(alpha_l, _TOL), device=q.device, dtype=q.dtype))
    log_r = torch.log(torch.tensor(1 - min(alpha_r, 1 - _TOL), device=q.device, dtype=q.dtype))
    return beta_l, q[..., 0] - beta_l * log_l, -beta_r, q[..., -1] - (-beta_r) * log_r


def inverse_cdf(q: Tensor, alphas: Tensor) -> Tensor:
    """Quantile function of sorted quantiles ``q (..., Q)`` at levels ``alphas (n,)`` -> ``(..., n)``."""
    levels = quantile_levels(q.shape[-1], q)
    alpha_l, alpha_r = levels[0].item(), levels[-1].item()
    alpha = alphas.expand(*q.shape[:-1], alphas.shape[-1])
    a_l, b_l, a_r, b_r = (c[..., None] for c in _tails(q, levels))
    left = a_l * torch.log(alpha.clamp(min=_TOL)) + b_l
    right = a_r * torch.log((1 - alpha).clamp(min=_TOL)) + b_r

    num_segments = q.shape[-1] - 1
    seg = (torch.searchsorted(levels[:-1].contiguous(), alpha.contiguous(), right=True) - 1).clamp(
        0, num_segments - 1
    )
    lo_levels = levels[:-1].expand(*q.shape[:-1], num_segments)
    hi_levels = levels[1:].expand(*q.shape[:-1], num_segments)
    q_lo, q_hi = q[..., :-1].gather(-1, seg), q[..., 1:].gather(-1, seg)
    a_lo, a_hi = lo_levels.gather(-1, seg), hi_levels.gather(-1, seg)
    t = (alpha - a_lo) / (a_hi - a_lo).clamp(min=_TOL)
    spline = q_lo + t.clamp(0.0, 1.0) * (q_hi - q_lo)
    spline = torch.where(alpha >= alpha_r, q[..., -1:].expand_as(spline), spline)
    return torch.where(alpha < alpha_l, left, torch.where(alpha > alpha_r, right, spline))


def quantile_stats(
    raw_quantiles: Tensor,
    output_type: str | Sequence[str] = "mean",
    alphas: Sequence[float] | None = None,
) -> Tensor | dict[str, Tensor]:
    """Statistics of raw quantile outputs ``(..., Q)``.

    ``mean``, ``variance``, ``median``: ``(...)``; ``quantiles``: ``(..., len(alphas))``;
    ``raw_quantiles``: the sorted ``(..., Q)``. A list of types returns a dict.

    Raises:
        ValueError: unknown output type or a level outside [0, 1].
    """
    types = [output_type] if isinstance(output_type, str) else list(output_type)
    unknown = [t for t in types if t not in OUTPUT_TYPES]
    if unknown or not types:
        raise ValueError(f"unknown output_type {unknown or types}; expected some of {OUTPUT_TYPES}")
    q = torch.sort(raw_quantiles, dim=-1).values
    results = {}
    for kind in types:
        if kind == "mean":
            results[kind] = q.mean(dim=-1)
        elif kind == "variance":
            results[kind] = q.var(dim=-1)
        elif kind == "median":
            results[kind] = inverse_cdf(q, torch.tensor([0.5], device=q.device, dtype=q.dtype))[
                ..., 0
            ]
        elif kind == "quantiles":
            levels = list(DEFAULT_ALPHAS if alphas is None else alphas)
            if not levels or not all(0.0 <= a <= 1.0 for a in levels):
                raise ValueError(
                    f"alphas must be a non-empty list of levels in [0, 1], got {levels}"
                )
            results[kind] = inverse_cdf(q, torch.tensor(levels, device=q.device, dtype=q.dtype))
        else:
            results[kind] = q
    return results[types[0]] if len(types) == 1 else results
