"""The worker's layer contract: what every layer of a model declares when it is built.

A model builds its layers from the worker's layer types (layers.py, moe.py and the families' own
attention and MLP blocks), each a ``Layer``:
- its tensor-parallel role (``Split``), fixed at construction: tensor_parallel.py shards by it and
  finds nothing by attribute name;
- its kernel slots (``kernel_slots``): the attributes a device backend may fill, through ``attach``
  alone, with its own computation (a matmul in its weight layouts, a fused small op, a router);
- its options (``options()``): every constructor choice that changes what it computes beyond its
  shapes. A fast path that runs a layer outside its module (the CPU's one-call decode) admits the
  layer only when it knows the layer's type and every one of these options, so a new option keeps
  a model on its modules rather than on a path that ignores it.

The loaders fill the weight slots (parameters, or a GGUF's blocks in ``quantized``) by layer type.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

from torch import nn


class Split(enum.Enum):
    """How a layer's weights are divided over the ranks under --tp-size N (Megatron's split)."""

    REPLICATED = "replicated"  # whole on every rank (norms, embeddings, a router)
    COLUMN = "column"  # this rank's output rows (of each part of a merged Linear); no communication
    ROW = "row"  # this rank's input columns; the partial products summed over the ranks
    VOCAB = "vocab"  # the LM head's vocabulary rows; the logits gathered over the ranks
    EXPERTS = "experts"  # a contiguous range of whole experts; their weighted sums summed


class Layer(nn.Module):
    """A worker layer type. Subclasses name their kernel slots; ``attach`` is the one way a backend
    sets them (an undeclared slot is an error, not a new attribute)."""

    split: Split = Split.REPLICATED
    kernel_slots: ClassVar[tuple[str, ...]] = ()

    def attach(self, **kernels: Any) -> None:
        """Fill declared kernel slots (``None`` empties one: the module's own torch code runs)."""
        for slot, kernel in kernels.items():
            assert slot in self.kernel_slots, f"{type(self).__name__} has no kernel slot {slot!r}"
            object.__setattr__(self, slot, kernel)  # a plain attribute, never a submodule

    def options(self) -> dict[str, Any]:
        """The choices beyond its shapes that change what this layer computes."""
        return {}


class AttentionLayer(Layer):
    """An attention block over its own heads: tensor parallel keeps 1/N of them on each rank (its
    q/k/v a column-parallel Linear, its output projection a row-parallel one)."""

    num_heads: int
    num_kv_heads: int

    def split_heads(self, world: int) -> None:
        assert self.num_heads % world == 0 and self.num_kv_heads % world == 0, (
            f"{self.num_heads} heads, {self.num_kv_heads} KV heads over {world} ranks"
        )
        self.num_heads //= world
        self.num_kv_heads //= world
