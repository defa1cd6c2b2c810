"""Gaussian noise on the hidden states that leave the client (the Nesa paper's tunable privacy parameter, eq. 25).

`sigma` is relative: each token's noise has standard deviation `sigma` times that token's own root-mean-square
hidden value, so one sigma means the same thing at every depth and in every model. sigma 0 adds nothing. The noise
buys privacy with quality: `nesa-node privacy-check` measures both (token recovery by an adversary, perplexity).
"""

from __future__ import annotations

import math

import torch


def check_sigma(sigma: float) -> float:
    """`sigma` as a float; ValueError unless it is finite and at least 0."""
    sigma = float(sigma)
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"noise sigma must be a finite number >= 0, got {sigma}")
    return sigma


def add_boundary_noise(hidden: torch.Tensor, sigma: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """`hidden` (..., hidden_size) plus Gaussian noise of `sigma` times each vector's RMS; `hidden` itself when
    sigma is 0. Computed in float32, returned in `hidden`'s dtype and device."""
    sigma = check_sigma(sigma)
    if sigma == 0:
        return hidden
    values = hidden.float()
    scale = values.pow(2).mean(dim=-1, keepdim=True).sqrt()  # (..., 1): each token's RMS
    noise = torch.randn(values.shape, generator=generator, dtype=torch.float32, device="cpu").to(values.device)
    return (values + sigma * scale * noise).to(hidden.dtype)


__all__ = ["add_boundary_noise", "check_sigma"]
