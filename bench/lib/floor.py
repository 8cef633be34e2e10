"""A decode token's floor: the weight bytes one token reads, over the memory's read pace.

At one stream a CPU decode step streams the model's weights once, so no engine decodes a token in
less time than ``decode_bytes(gguf) / read_bandwidth()``. bench.targets reports each engine's
one-stream time per token against this floor, measured beside it.
"""

from __future__ import annotations

import time
from pathlib import Path

EMBEDDING = "token_embd.weight"
HEAD = "output.weight"
PER_LAYER_EMBEDDING = "per_layer_token_embd.weight"  # Gemma 4's per-layer inputs: a lookup, never a head


def decode_bytes(gguf: Path) -> int:
    """The weight bytes a one-row decode step of ``gguf`` reads: every tensor once, but one row of the
    token embedding when the file has its own head (else the embedding is the head, read whole) and
    of a per-layer token embedding (Gemma 4's, looked up for every layer at once), and
    of a mixture of experts' stacked expert tensors (``*_exps``) the share of the experts a token
    uses (expert_used_count / expert_count)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))

    def field(name: str) -> int | str | None:
        f = reader.fields.get(name)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types and f.types[0].name == "STRING" else int(value[0])

    arch = field("general.architecture")
    used, count = field(f"{arch}.expert_used_count"), field(f"{arch}.expert_count")
    names = {t.name for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        n = int(t.n_bytes)
        if (t.name == EMBEDDING and HEAD in names) or t.name == PER_LAYER_EMBEDDING:
            n //= int(t.shape[-1])  # one row of [rows, hidden] (GGUF lists the shape innermost first)
        elif "_exps." in t.name and isinstance(used, int) and isinstance(count, int) and count > 0:
            n = n * used // count
        total += n
    return total


def read_bandwidth(mb: int = 256, repeats: int = 10) -> float:
    """GB/s of a streaming read on all threads (torch's sum over ``mb`` MB of float32, best of
    ``repeats``): the memory's pace, against which a one-row pass's GB/s is read."""
    import torch

    t = torch.ones(mb << 18)  # mb MB of float32
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - started)
    return t.numel() * 4 / best / 1e9


def floor_x(tpot_ms: float, decode_bytes: int, gbps: float) -> float:
    """A token's time over its floor: ``tpot_ms`` against ``decode_bytes`` read at ``gbps`` GB/s."""
    return tpot_ms / (decode_bytes / gbps / 1e6)
