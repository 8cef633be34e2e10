"""The worker's layer types that every model file shares (each a ``contract.Layer``: its
tensor-parallel split, kernel slots and options declared when it is built), and small functions.

Parameters are created with ``torch.empty`` (no random init: the loader
overwrites every one of them), and nothing else is: ``load_model`` builds a model
with them on the meta device (weights/common.py, ``parameters_on_meta``), so
building one allocates nothing and a weight kept in a GGUF's blocks never is.
Each block mirrors the op order of the HF reference where that order decides
rounding, so float64 runs can be compared with HF to ~1e-12.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.contract import Layer, Split

if TYPE_CHECKING:
    from gpu_worker.weights.formats import QuantizedWeight


class LinearImpl(Protocol):
    """A device backend's own matmul for one Linear (its weight layouts, its kernels)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


class GatedImpl(Protocol):
    """A device backend's ``silu(x W_0^T) * (x W_1^T)`` of a Linear of two equal parts (an MLP's gate
    and up) in one call, with the bits of the Linear's output and then ``FusedOps.silu_mul``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class EmbeddingImpl(Protocol):
    """A device backend's row lookup for an embedding whose table it holds in its own layout."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor: ...


class FusedOps(Protocol):
    """A device backend's one-call versions of the layers' small ops, rounding as the torch code."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def rotary_(self, x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def softcap_(self, x: torch.Tensor, cap: float) -> None: ...


class BlocksOrWeight(Layer):
    """A layer whose weight slot is ``weight``, or ``quantized``: a GGUF's blocks, which only a
    backend with kernels for them computes on (gguf_weights.py fills it)."""

    weight: nn.Parameter
    quantized: QuantizedWeight | None = None

    def hold_blocks(self, weight: QuantizedWeight) -> None:
        """Loading: the weight is ``weight``'s blocks; the parameter, never written, is emptied
        (which frees its address space)."""
        self.quantized = weight
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)


class Linear(BlocksOrWeight):
    """``y = x W^T + b`` with HF's [out, in] weight layout, and its tensor-parallel ``split``.

    Kernel slot ``impl``: a device backend's matmul in its own weight layouts (on CPU,
    gpu_worker/backends/cpu/matmul.py); ``release_weight`` then frees the loaded weight it copied.
    Weight slots: ``weight`` and ``bias``, or ``quantized``: the weight as a GGUF's blocks
    (gguf_weights.py), which only a backend with kernels for them computes on. ``vocab_span``: the
    vocabulary rows this rank holds, where tensor parallel splits an LM head (``Split.VOCAB``).
    """

    kernel_slots: ClassVar[tuple[str, ...]] = ("impl",)  # (MergedLinear's add one)
    impl: LinearImpl | None = None
    vocab_span: tuple[int, int, int] | None = None  # (start, stop, vocab)

    def __init__(
        self, in_features: int, out_features: int, bias: bool, split: Split = Split.REPLICATED
    ) -> None:
        super().__init__()
        self.split = split
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def options(self) -> dict[str, Any]:
        return {"bias": self.bias is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl is not None:
            return self.impl(x)
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, as one op where the backend fuses the add."""
        if self.impl is not None:
            return self.impl.add_to(residual, x)
        return residual + self(x)

    def release_weight(self) -> None:
        """Free the loaded weight once ``impl`` holds its own copies (a tied embedding keeps its own
        reference, so a shared table stays)."""
        assert self.impl is not None, "the weight is released only to a backend's matmul"
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)


class MergedLinear(Linear):
    """Several projections of one input in a single matmul (q/k/v, or gate/up): column-parallel,
    each part split on its own.

    ``shards`` names the checkpoint's separate projections (siblings of this
    module, e.g. ``q_proj``) and the block of output rows each one fills, in
    order; the loader copies each checkpoint weight into its block. ``fused_checkpoint``: the
    checkpoint holds this merged weight as one tensor under this module's own name (Phi-3, GPT-2);
    the shards then only say where each projection's rows are (tensor parallel splits them).

    Kernel slot ``silu_mul`` (besides ``impl``): where a backend fuses it, ``silu`` of the first of two
    equal parts times the second, in one call (an MLP's gate and up: llama.py's ``MLP``).
    """

    kernel_slots = ("impl", "silu_mul")
    silu_mul: GatedImpl | None = None

    def __init__(
        self, in_features: int, shards: dict[str, int], bias: bool, fused_checkpoint: bool = False
    ) -> None:
        super().__init__(in_features, sum(shards.values()), bias, Split.COLUMN)
        self.fused_checkpoint = fused_checkpoint
        self.set_parts(list(shards), list(shards.values()))

    def set_parts(self, names: list[str], sizes: list[int]) -> None:
        """The parts' names and row counts, in order (tensor parallel sets this rank's)."""
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.shards = {name: (start, rows) for name, start, rows in zip(names, starts, sizes, strict=True)}
        self.sizes = sizes


class Embedding(BlocksOrWeight):
    """Rows of a [num, dim] table, whole on every rank; ``impl`` and ``quantized`` as in ``Linear``."""

    kernel_slots = ("impl",)
    impl: EmbeddingImpl | None = None

    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.impl is not None:
            return self.impl(ids)
        return F.embedding(ids, self.weight)


class RMSNorm(Layer):
    """RMSNorm whose statistics are taken in float32, as HF does for every model dtype.

    (For bf16 this is the accurate choice; for float64 it matches the reference bit for bit.)
    ``fused`` (set by a device backend): one call for [T, dim] rows (bit-equal in bf16), or for
    float32 [T, heads, dim] ones.
    """

    kernel_slots = ("fused",)
    fused: FusedOps | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.stride(-1) == 1:
            if x.dim() == 2:
                return self.fused.rms_norm(x, self.weight, self.eps)
            if x.dim() == 3 and x.dtype == torch.float32:  # a norm per head (Qwen3's q and k), one call
                # (float32 only: over a head's few dims the kernel's sum is not torch's bit for bit)
                return self.fused.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        # torch's one call takes the reference's steps in the same order (equal bit for bit over
        # random SmolLM2-sized rows, float32 and bf16 inputs) in fewer dispatches: 4 ops, not 8,
        # for bf16, and less time at 1 row in float32 (docs/benchmarks-history.md).
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps).to(x.dtype)


class LayerNorm(Layer):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written as the reference writes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """torch's tanh GELU, as HF's ``gelu_pytorch_tanh`` calls it (not bit-equal to ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation an HF config names (``hidden_act`` / ``activation_function``)."""
    match name:
        case "silu" | "swish":
            return F.silu
        case "gelu_new" | "gelu_fast":
            return gelu_new
        case "gelu_pytorch_tanh":  # HF's GELUTanh: torch's own tanh approximation (Gemma)
            return gelu_tanh
        case "gelu":
            return F.gelu
        case "relu":
            return F.relu
        case _:
            raise NotImplementedError(f"activation {name!r} is not supported")


class PositionTable(nn.Module):
    """A table with one row per position (a rope's cos/sin), built for the model's whole context.
    ``keep_positions`` drops the rows past what the engine serves (the KV pool bounds every
    sequence): the worker calls it once, before any kernel reads the table's storage."""

    def keep_positions(self, rows: int) -> None:
        """Keep the first ``rows`` rows of every table, in storage of their own."""
        for name, table in self.named_buffers(recurse=False):
            if table.shape[0] > rows:
                setattr(self, name, table[:rows].clone())


def keep_positions(model: nn.Module, rows: int) -> None:
    """Every position table of ``model`` cut to its first ``rows`` positions."""
    for module in model.modules():
        if isinstance(module, PositionTable):
            module.keep_positions(rows)


class RotaryCache(PositionTable):
    """cos/sin of every position up to ``context_len``, looked up per token.

    Angles are computed in float32 and then cast, as HF does, so every model
    dtype sees the same angles as the reference. ``sin`` is stored with its
    first half negated (see ``apply_rotary``).
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, scaling: float, context_len: int) -> None:
        super().__init__()
        positions = torch.arange(context_len, dtype=torch.float32)  # on the default (model) device
        freqs = positions[:, None] * inv_freq.to(positions.device, torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        signs = torch.cat((-torch.ones_like(freqs[0]), torch.ones_like(freqs[0])))
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype) * signs.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, signed sin of shape [T, 1, head_dim] (broadcast over heads)."""
        # index_select, not cos[positions]: advanced indexing is several times slower on CPU.
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(
            0, positions
        ).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the half-split (NeoX/HF) convention.

    HF computes ``x * cos + cat(-x2, x1) * sin``. With the sign folded into
    ``signed_sin`` the swap is one flip and no negation, and the products are
    the same numbers (negation is exact), so every dtype matches HF bit for
    bit: 4 ops and 2 temporaries instead of 6 and 5.
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # cat(x2, x1)
    out = x * cos
    out += swapped.mul_(signed_sin)
    return out
