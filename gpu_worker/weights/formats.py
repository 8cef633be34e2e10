"""How a weight is held when it is not a plain tensor: a GGUF's quantized blocks, as data.

A format is data, not a subclass: ``QuantBlocks`` carries its ggml type id and bytes, and the
backend that computes on it picks the kernel (gpu_worker/backends/cpu/quant.py). Nothing here
knows a kernel or a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FILE_LAYOUT = "file"  # the GGUF's own bytes, each row's blocks in order
# 16-bit float weights (ggml F16, BF16) held as "blocks" of this many values: a row holds whole
# groups (the loader widens others at load), and a split of the row falls on them.
SIXTEEN_BIT_GROUP = 32
SIXTEEN_BIT_TYPES = (1, 30)  # ggml F16, BF16


@dataclass(frozen=True)
class QuantBlocks:
    """Rows of one weight in a GGUF block type: ``data`` is uint8 [rows, row_bytes], the file's
    blocks of each row in the model's row order (``layout`` FILE_LAYOUT). A backend may hold the
    same bytes in a layout of its own; it names it in ``layout`` and alone can read it."""

    type: int  # ggml type id (gguf.GGMLQuantizationType)
    data: torch.Tensor
    cols: int
    layout: str = FILE_LAYOUT

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], by gguf's own dequantization (of the file's layout only)."""
        assert self.layout == FILE_LAYOUT, f"{self.layout!r} blocks are read by their backend alone"
        return dequantize_blocks(self.type, self.data.numpy(), (self.rows, self.cols))

    @property
    def block(self) -> tuple[int, int]:
        """(weights, bytes) of one block of this type."""
        import gguf

        if self.type in SIXTEEN_BIT_TYPES:
            return SIXTEEN_BIT_GROUP, 2 * SIXTEEN_BIT_GROUP
        elements, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.type)]
        return int(elements), int(nbytes)

    def column_span(self, start: int, cols: int) -> QuantBlocks:
        """Input columns [start, start + cols) of every row: whole blocks (both on block boundaries,
        else ValueError), copied into rows of their own."""
        elements, nbytes = self.block
        if start % elements or cols % elements:
            raise ValueError(f"columns [{start}, {start + cols}) do not fall on blocks of {elements}")
        assert self.layout == FILE_LAYOUT, f"{self.layout!r} blocks are split by their backend alone"
        data = self.data.narrow(1, start // elements * nbytes, cols // elements * nbytes).contiguous()
        return QuantBlocks(self.type, data, cols)


@dataclass(frozen=True)
class QuantizedWeight:
    """A Linear's or an embedding's [out, in] weight as row blocks of quantized rows, in order:
    one part, or one per projection of a merged Linear whose projections differ in type."""

    parts: tuple[QuantBlocks, ...]

    @property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(part.data.numel() for part in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])

    def rows_of(self, spans: list[tuple[int, int]]) -> QuantizedWeight:
        """The rows of ``spans`` ((start, count) over all parts' rows, in order, each within one
        part), by part: views of whole rows, nothing dequantized."""
        parts, offset = [], 0
        for part in self.parts:
            end = offset + part.rows
            inside = [(s - offset, n) for s, n in spans if offset <= s and s + n <= end]
            assert all(s + n <= offset or s >= end for s, n in spans if (s - offset, n) not in inside), (
                f"a span of {spans} crosses a part's end at row {end}"
            )
            if inside:
                views = [part.data.narrow(0, s, n) for s, n in inside]
                data = views[0] if len(views) == 1 else torch.cat(views)
                parts.append(QuantBlocks(part.type, data, part.cols, part.layout))
            offset = end
        return QuantizedWeight(tuple(parts))


def dequantize_blocks(ggml_type: int, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's values as float32 of ``shape``, by gguf's dequantization (a copy: the file is mapped)."""
    import gguf

    values = gguf.quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)


@dataclass(frozen=True)
class QuantizedExperts:
    """A mixture-of-experts layer's expert weights as a GGUF stacks them: per projection (gate, up:
    [inner, hidden] per expert; down: [hidden, inner]) one ``QuantBlocks`` of all experts' rows,
    expert e's the rows [e * rows, (e + 1) * rows). The three may differ in type."""

    gate: QuantBlocks
    up: QuantBlocks
    down: QuantBlocks
    num_experts: int

    @property
    def projections(self) -> tuple[QuantBlocks, QuantBlocks, QuantBlocks]:
        return self.gate, self.up, self.down

    def expert(self, e: int) -> tuple[QuantBlocks, QuantBlocks, QuantBlocks]:
        """Expert e's gate, up and down blocks: views of its rows."""
        return self.experts_of(e, 1).projections

    def experts_of(self, first: int, count: int) -> QuantizedExperts:
        """Experts [first, first + count): each projection's rows of them, a view of the blocks
        (whole rows, so every block stays whole)."""
        parts = []
        for part in self.projections:
            rows = part.rows // self.num_experts
            data = part.data.narrow(0, first * rows, count * rows)
            parts.append(QuantBlocks(part.type, data, part.cols, part.layout))
        return QuantizedExperts(parts[0], parts[1], parts[2], count)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 gate_up [E, 2 * inner, hidden] (gate rows first) and down [E, hidden, inner]."""
        gate, up, down = (p.dequantize().view(self.num_experts, -1, p.cols) for p in self.projections)
        return torch.cat([gate, up], dim=1), down
