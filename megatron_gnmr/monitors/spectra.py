"""Spectral entropy of update matrices, and the QK-product increment through small QR cores.

For a head with query/key projections A = W_q^h, B = W_k^h (d_model x d_head, old weights)
and increments dA, dB, the QK-product increment splits into D1 = D2 + D3 with
D2 = dA B^T + A dB^T (first order, the early-warning signal) and D3 = dA dB^T. D2 is never
formed: D2 = [dA, A] [B, dB]^T = X Y^T; with thin QR X = Qx Rx, Y = Qy Ry, the singular
values of D2 are those of the 2 d_head x 2 d_head core Rx Ry^T (Qx, Qy have orthonormal
columns). Cost O(d_model d_head^2) per head instead of O(d_model^3). D3 likewise from the
QR of dA and dB. All in float64: the spectra of small increments are ill-conditioned.
"""

from __future__ import annotations

import math

import torch


def spectral_entropy(singular_values: torch.Tensor) -> dict[str, float]:
    """H = -sum p log p with p_i = s_i^2 / sum s^2; also H / log(rank) and exp(H)."""
    energy = singular_values.double().square()
    total = energy.sum()
    if total <= 0:
        return {"entropy": 0.0, "normalized": 0.0, "effective_rank": 1.0}
    p = energy / total
    p = p[p > 0]
    entropy = float(-(p * p.log()).sum())
    rank = singular_values.numel()
    return {"entropy": entropy,
            "normalized": entropy / math.log(rank) if rank > 1 else 0.0,
            "effective_rank": math.exp(entropy)}


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(matrix.double())


def _product_singular_values(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Singular values of X Y^T (both tall, d x k) from the k x k core Rx Ry^T."""
    # mode="r": only the triangular factor is needed (Q is never formed: half the work).
    _, r_x = torch.linalg.qr(x.double(), mode="r")
    _, r_y = torch.linalg.qr(y.double(), mode="r")
    return torch.linalg.svdvals(r_x @ r_y.T)


def d2_singular_values(a, b, da, db) -> torch.Tensor:
    """Singular values of D2 = dA B^T + A dB^T (A, B, dA, dB: d_model x d_head)."""
    return _product_singular_values(torch.cat([da, a], dim=1), torch.cat([b, db], dim=1))


def d3_singular_values(da, db) -> torch.Tensor:
    """Singular values of D3 = dA dB^T."""
    return _product_singular_values(da, db)
