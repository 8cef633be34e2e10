"""Rotary frequencies from an HF config, old and new spellings alike."""

from __future__ import annotations

from typing import Any

import torch

# Types whose frequencies depend on the current sequence length: not a fixed cache.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """transformers 5 keeps rope settings in ``rope_parameters``; older ones in rope_theta/rope_scaling."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
    scaling = getattr(cfg, "rope_scaling", None) or {}
    params.setdefault("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    return params


def rope_inv_freq(cfg: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float32, attention scaling of cos/sin)."""
    params = rope_parameters(cfg)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
    if rope_type in _LENGTH_DEPENDENT:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported")
    # Static scalings (linear, llama3, yarn, ...): HF's own table computes their frequencies.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(scaling)
