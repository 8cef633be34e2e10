"""The interleaved weights' arena (backends/cpu/hugepages.py): where its tensors lie, that the
weights re-laid into it are the bytes re-laid anywhere, that a prepared model holds them all there,
and that Linux backs it with huge pages where transparent huge pages are on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu.hugepages import ALIGN, HUGE_PAGE, HugePageArena, arena_bytes
from gpu_worker.backends.cpu.layouts import X8_LAYOUT, interleave_rows, interleaves
from gpu_worker.weights.formats import QuantBlocks
from tests.gpu_worker import test_quant_kernels as legacy
from tests.gpu_worker.test_quant_k_kernels import weights


def test_tensors_are_aligned_apart_and_the_arena_refuses_past_its_end() -> None:
    arena = HugePageArena(arena_bytes([100, 4096, 7]))
    a, b, c = arena.take((10, 10)), arena.take((4096,)), arena.take((7,))
    assert a.data_ptr() % HUGE_PAGE == 0
    assert b.data_ptr() - a.data_ptr() == 128 and c.data_ptr() - b.data_ptr() == 4096
    a.fill_(1), b.fill_(2), c.fill_(3)
    assert int(a.sum()) == 100 and int(b.sum()) == 2 * 4096 and int(c.sum()) == 21
    assert a.dtype == torch.uint8 and a.is_contiguous() and c.data_ptr() % ALIGN == 0
    with pytest.raises(ValueError, match="arena full"):
        arena.take((1,))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_blocks_relaid_into_the_arena_are_the_bytes_relaid_anywhere(qtype: Q) -> None:
    made = legacy.weights(qtype, 24, 512)[0] if qtype in legacy.LEGACY else weights(qtype, 24, 512)[0]
    blocks = QuantBlocks(int(qtype), torch.from_numpy(made), 512)
    assert interleaves(blocks)
    arena = HugePageArena(arena_bytes([blocks.data.numel()]))
    slot = arena.take(tuple(blocks.data.shape))
    placed = interleave_rows(blocks, slot)
    assert placed.layout == X8_LAYOUT and placed.data.data_ptr() == slot.data_ptr()
    assert torch.equal(placed.data, interleave_rows(blocks).data)


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_linux_backs_the_arena_with_huge_pages() -> None:
    arena = HugePageArena(4 * HUGE_PAGE)
    t = arena.take((4 * HUGE_PAGE,))
    t.fill_(7)  # the first touch: the fault takes a 2 MB page
    start = t.data_ptr()
    huge_kb, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= start < hi
        elif inside and head == "AnonHugePages:":
            huge_kb = int(line.split()[1])
    assert arena.huge and huge_kb >= 2048, f"{huge_kb} kB of the arena's mapping in huge pages"
