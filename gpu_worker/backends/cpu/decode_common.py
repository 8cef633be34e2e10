"""What the one-call decodes (decode_layers.py, decode_hybrid.py, decode_mla.py) share: a decoder
layer checked against the positive list of the kinds and options their C code implements, and the
log line that says which way a model's decode steps run."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from gpu_worker.models.contract import Layer

# Each layer kind the C code implements -> each option it implements -> whether it takes the value.
CLayers = Mapping[type[nn.Module], Mapping[str, Callable[[Any], bool]]]


def anything(value: object) -> bool:
    return True


def off(value: object) -> bool:
    return not value


def not_listed(table: CLayers, layer: nn.Module) -> str | None:
    """The first part of a decoder layer whose kind or option ``table`` does not take (None: all are)."""
    for name, module in layer.named_modules():
        known = table.get(type(module))
        if known is None or not isinstance(module, Layer):
            return f"{name or 'the layer'}: {type(module).__name__} has no C decode"
        for option, value in module.options().items():
            if option not in known or not known[option](value):
                return f"{name or 'the layer'}: {type(module).__name__}'s {option}={value!r} has no C decode"
    return None


def runs_as_one_call(logger: logging.Logger, reason: str | None, source: str) -> bool:
    """Whether decode steps run as one call of ``source`` (no ``reason`` against), logged either way."""
    if reason is not None:
        logger.info("decode steps run layer by layer: %s", reason)
        return False
    logger.info("decode steps run every layer in one C call (%s)", source)
    return True
