"""Rotary frequencies from an HF config, old and new spellings alike, and the cos/sin cache a
model looks its positions up in.

Static scalings (linear, llama3, yarn) come from HF's own table, so their frequencies are HF's. Two
more kinds:
- a GGUF's Llama 3 ``rope_freqs`` factors (gguf_config.py puts them in the config): llama.cpp
  divides each frequency by its factor; HF's llama3 scaling computes the same numbers (to float32
  rounding) from the four parameters the GGUF no longer carries.
- LongRoPE (Phi-3, ``longrope``/``su``): HF rotates with the short factors while a forward's
  sequence stays within ``original_max_position_embeddings`` and with the long ones for the whole
  forward beyond it (its cache keeps earlier keys as they were rotated). A position's rotation must
  not depend on how the scheduler batched or chunked its sequence (the radix cache shares K/V across
  requests), so each position takes its own: the short factors below the original length, the
  long ones from it. Exact against HF for every sequence within the original length.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.models.layers import RotaryCache
from gpu_worker.weights.gguf_config import FREQ_FACTORS_KEY

# Types whose frequencies depend on the current sequence length: not a fixed cache.
_LENGTH_DEPENDENT = ("dynamic",)


def rope_parameters(cfg: Any, layer_type: str | None = None) -> dict[str, Any]:
    """transformers 5 keeps rope settings in ``rope_parameters`` (per layer type where layers
    differ: Gemma 3); older ones in rope_theta/rope_scaling."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
    scaling = getattr(cfg, "rope_scaling", None) or {}
    params.setdefault("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    return params


def rope_inv_freq(cfg: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float32, attention scaling of cos/sin)."""
    params = rope_parameters(cfg, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
        factors = getattr(cfg, FREQ_FACTORS_KEY, None)
        if factors is not None:
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
        return inv_freq, 1.0
    if rope_type in _LENGTH_DEPENDENT or rope_type == "longrope":
        raise NotImplementedError(f"rope type {rope_type!r} has no fixed frequencies (see rotary_cache)")
    return _hf_inv_freq(cfg, rope_type, layer_type)


def _hf_inv_freq(
    cfg: Any, rope_type: str, layer_type: str | None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """HF's own table (linear, llama3, yarn, longrope, ...)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported")
    kwargs: dict[str, Any] = {} if layer_type is None else {"layer_type": layer_type}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), **kwargs)
    return inv_freq.to(torch.float32), float(scaling)


def rotary_cache(cfg: Any, head_dim: int, context_len: int, layer_type: str | None = None) -> RotaryCache:
    """cos/sin of every position below ``context_len`` for ``cfg``'s rope (of ``layer_type``'s
    layers where layer types differ)."""
    params = rope_parameters(cfg, layer_type)
    if params["rope_type"] in ("longrope", "su"):
        return _longrope_cache(cfg, params, context_len, layer_type)
    inv_freq, scaling = rope_inv_freq(cfg, head_dim, layer_type)
    return RotaryCache(inv_freq, scaling, context_len)


def _longrope_cache(
    cfg: Any, params: dict[str, Any], context_len: int, layer_type: str | None
) -> RotaryCache:
    """The short factors' rows below the original length, the long factors' from it (module docstring)."""
    original = int(params.get("original_max_position_embeddings") or cfg.original_max_position_embeddings)
    short, scaling = _hf_inv_freq(cfg, "longrope", layer_type)
    cache = RotaryCache(short, scaling, context_len)
    if context_len > original:
        long, long_scaling = _hf_inv_freq(cfg, "longrope", layer_type, seq_len=original + 1)
        tail = RotaryCache(long, long_scaling, context_len)
        cache.cos[original:] = tail.cos[original:]
        cache.sin[original:] = tail.sin[original:]
    return cache
