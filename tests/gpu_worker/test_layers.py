"""Layer helpers that change how a model is reached, not what it computes."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.backends.cpu.backend import pin_attributes
from gpu_worker.models.layers import Linear


def test_pinned_attributes_are_the_registered_ones_and_follow_reassignment() -> None:
    model = nn.Sequential(Linear(4, 3, bias=True), nn.Sequential(Linear(3, 2, bias=False)))
    model.register_buffer("scale", torch.ones(2))
    pin_attributes(model)
    first = model[0]
    assert model.__dict__["0"] is first and first.__dict__["weight"] is first._parameters["weight"]
    assert model.__dict__["scale"] is model._buffers["scale"]
    new_weight = nn.Parameter(torch.zeros(3, 4), requires_grad=False)
    first.weight = new_weight  # as the CPU backend does after loading
    assert first.weight is new_weight and first._parameters["weight"] is new_weight
    with torch.no_grad():  # the layer's parameters start uninitialised: a NaN there would never compare equal
        first.bias.copy_(torch.tensor([1.0, -2.0, 3.0]))
    x = torch.ones(1, 4)
    assert torch.equal(first(x), first.bias.expand(1, 3)), "the forward reads the reassigned weight"
