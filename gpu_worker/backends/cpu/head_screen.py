"""A 16-bit LM head's one-row greedy draw screened by an int8 copy of it (csrc/head_screen.c).

A one-row greedy step whose head is BF16 or F16 reads 2 bytes a weight of the head only to take the
argmax of its logits (sampling/head_argmax.py); gpt-oss's 201088-row head is 1.16 GB, over half the
step's bytes. The screen, built at load beside such a head, is an int8 copy (one float scale a row)
and a radius a row: a step reads the copy (half the bytes), bounds each row's distance to the
head's own value rigorously, and computes exactly, by the head's own tile, only the rows that could
be the largest (how many: docs/benchmarks-history.md, "The screened greedy head"). The token is the
full route's, bit for bit, on every input (csrc/head_screen.c's top comment has the bound;
tests/gpu_worker/test_head_screen.py).

Which heads: the LM head alone (prepare.py's ``_screened_head``), 16-bit in the file's layout with at
least ``SCREEN_MIN_ROWS`` rows (a vocabulary: there the copy's bytes are a large share of a step),
unless ``RIVULET_HEAD_SCREEN=0`` (no copy built, no memory spent). Which rows: one
(``QuantLinear.argmax``; two or more rows run the full route: their exact values come from other tiles,
and many rows are bound by arithmetic, not bytes), without a soft-cap (tanh can round distinct logits to
one value; a capped head keeps the full route). The C global ``head_screen`` (1) turns the screen off at
run time (0), for ``bench.worker_step --toggle head_screen``.
"""

from __future__ import annotations

import os

import torch
from gguf import GGMLQuantizationType

from gpu_worker.backends.cpu.hugepages import HugePageArena
from gpu_worker.backends.cpu.layouts import kernel_type
from gpu_worker.backends.cpu.quant_kernels import QuantKernels
from gpu_worker.weights.formats import FILE_LAYOUT, QuantBlocks, QuantizedWeight

SCREEN_MIN_ROWS = 32768
SIXTEEN_BITS = frozenset({int(GGMLQuantizationType.BF16), int(GGMLQuantizationType.F16)})
# At most this many candidates a step (else the full route): past a few thousand rows their exact
# values cost as much as the copy's saving (a row of 2880 BF16 weights is 5.8 KB).
MAX_CANDIDATES = 4096
ENV = "RIVULET_HEAD_SCREEN"  # "0": build no screen


def screens(part: QuantBlocks) -> bool:
    """Whether a head of these blocks gets a screen."""
    wanted = os.environ.get(ENV, "1") != "0"
    return (
        wanted
        and part.layout == FILE_LAYOUT
        and kernel_type(part) in SIXTEEN_BITS
        and part.rows >= SCREEN_MIN_ROWS
    )


class HeadScreen:
    """The int8 copy of a 16-bit head, its per-row scales and radii, and a step's scratch."""

    def __init__(self, kernels: QuantKernels, part: QuantBlocks, q: torch.Tensor) -> None:
        n = part.rows
        self.kernels, self.part, self.q = kernels, part, q
        self.scale = torch.empty(n, dtype=torch.float32)
        self.radius = torch.empty(n, dtype=torch.float32)
        self.approx = torch.empty(n, dtype=torch.float32)
        m = min(MAX_CANDIDATES, n)
        self.cand = torch.empty(m, dtype=torch.int64)
        self.exact = torch.empty(m, dtype=torch.float32)
        self.candidates = -1  # the last step's count (-1: it ran the full route)

    @classmethod
    def build(cls, kernels: QuantKernels, part: QuantBlocks) -> HeadScreen | None:
        """The screen of ``part`` (``screens(part)``), its copy on huge pages; None where a weight is
        not finite."""
        q = HugePageArena(part.rows * part.cols).take((part.rows, part.cols))
        screen = cls(kernels, part, q)
        built = kernels.head_screen_build(
            kernel_type(part), part.data, part.cols, q, screen.scale, screen.radius
        )
        return screen if built else None

    def tensors(self) -> list[torch.Tensor]:
        """What the screen holds (counted in the worker's weight bytes)."""
        return [self.q, self.scale, self.radius]

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [1]: the full route's greedy token for the one row ``x`` (float32 or bfloat16, no cap)."""
        out = torch.empty(2, dtype=torch.int64)
        part = self.part
        run = self.kernels.head_screen_argmax
        run(kernel_type(part), part.data, part.cols, (self.q, self.scale, self.radius), x,
            (self.approx, self.cand, self.exact), out)  # fmt: skip
        self.candidates = int(out[1])
        return out[:1]


def screen_for(
    weight: QuantizedWeight, bias: torch.Tensor | None, kernels: QuantKernels
) -> HeadScreen | None:
    """A screen for a Linear of ``weight`` (+ ``bias``) where ``screens`` takes it: one part, no bias."""
    if bias is not None or len(weight.parts) != 1 or not screens(weight.parts[0]):
        return None
    return HeadScreen.build(kernels, weight.parts[0])
