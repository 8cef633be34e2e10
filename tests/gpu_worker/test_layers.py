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


def test_keep_positions_cuts_every_position_table_to_its_first_rows() -> None:
    """Rope tables (RotaryCache's cos/sin, DeepSeek-V2's complex factors) keep their first rows, the
    same values, in storage of their own (the long table's is freed); shorter tables are left alone."""
    from gpu_worker.models.layers import RotaryCache, keep_positions
    from gpu_worker.models.mla import ComplexRotary

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    model = nn.ModuleDict(
        {
            "rope": RotaryCache(inv_freq, 1.0, 100),
            "complex": ComplexRotary(inv_freq, 0.5, 100),
            "short": RotaryCache(inv_freq, 1.0, 20),
        }  # fmt: skip
    )
    before = {name: t.clone() for name, t in model.named_buffers()}
    keep_positions(model, 30)
    after = dict(model.named_buffers())
    assert (
        sorted(after)
        == sorted(before)
        == ["complex.factors", "rope.cos", "rope.sin", "short.cos", "short.sin"]
    )
    for name, table in after.items():
        rows = 20 if name.startswith("short") else 30
        assert table.shape[0] == rows and table.is_contiguous(), name
        assert table.untyped_storage().nbytes() == table.numel() * table.element_size(), name
        assert torch.equal(table, before[name][:rows]), name
    cos, sin = model["rope"](torch.tensor([0, 29]))
    assert torch.equal(cos[:, 0], before["rope.cos"][[0, 29]]) and torch.equal(
        sin[:, 0], before["rope.sin"][[0, 29]]
    )
