"""Tensor parallel (--tp-size N): each worker rank holds 1/N of every layer's attention heads and
MLP columns (or of a mixture's experts), and one all-reduce per projection back into the residual
stream.

Per decoder layer (Megatron's split), as each layer declares it when the model builds it
(``Split``, models/contract.py); nothing here knows a projection's name:

    Split.COLUMN (q/k/v, gate/up)  this rank's heads / MLP columns (each part of a merged Linear
                                   split on its own), no communication; the attention runs on its
                                   own heads (``AttentionLayer.split_heads``) and KV pool
    Split.ROW (o, down)            this rank's input columns, the partial products summed over the
                                   ranks (``AllReduced``); the bias added once (rank 0 keeps it,
                                   the others zero it)

A mixture of experts' sparse block is expert-parallel: each rank holds a contiguous range of the
experts, whole (``_experts``); the router is replicated, so every rank routes every token alike and
computes the (token, expert) pairs of its own experts, weighted as one rank weights them; their
weighted sum per token (zeros where a token chose none of them) is summed over the ranks by the
same all-reduce (``ExpertsAllReduced``): one per sparse block. Not each expert's rows split: a
GGUF's K-quant blocks hold 256 weights along an expert's input, and Qwen3-30B-A3B's down projection
has 768 (3 blocks), which 2 ranks would cut; whole experts keep every block whole at any rank count,
and each rank reads 1/N of the experts' bytes either way. Contiguous ranges, not round-robin: a
rank's experts are one slice of the stacked weights or blocks (a view of the file, no gather), and
its pairs one slice of the pairs sorted by expert. A token's terms are added in ascending expert
order within a rank, the ranks' sums then in rank order: with top-2 the same floats as one rank
(a + b either way), with more the same sum within rounding, as the row-parallel Linears' are.

The LM head is vocab-parallel: each rank computes the logits of its share of the vocabulary
(``VocabGathered``), then every rank holds all of them and draws the same tokens (same seeds), so
each keeps its per-request state; rank 0 alone replies. A replicated head would have each rank read
the whole table per step; the split head plus its gather takes less time at 1 and 32 rows
(``python -m bench.tp_step``; docs/benchmarks.md, tensor parallel on CPU). The embedding (a row
lookup, cheap) and the norms are replicated.
A GGUF's blocks stay blocks (``QuantizedWeight``): a column-parallel Linear keeps whole rows, a
row-parallel one its share of each row's blocks, which needs the share of the input to be whole
blocks (32 or 256 weights); a split that is not is refused at start, naming the tensor. The
embedding stays whole on every rank (mapped from the file, shared by the page cache).
A backend's ``prepare_model`` applies both through ``prepare_rank``: ``shard`` on the full model as
loaded, then the backend's own layouts and kernels on this rank's part, then ``wrap_reductions``
around whatever matmul it chose, with the all-reduce the runner passes in (``TensorParallel``: the
backend's ``all_reduce``, shared memory on one machine for the CPU's, else gloo). The model files
stay free of this: they read their head counts from their modules, which ``shard`` sets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.contract import AttentionLayer, Split
from gpu_worker.models.layers import Linear, MergedLinear
from gpu_worker.models.mla import LatentProjection
from gpu_worker.models.moe import ExpertGroups, Experts
from gpu_worker.weights.formats import QuantizedWeight

AllReduce = Callable[[torch.Tensor], None]  # sums a contiguous float32/float64 tensor in place


@dataclass(frozen=True)
class TensorParallel:
    """What a backend's ``prepare_model`` needs under --tp-size > 1: this rank, the group's size, and
    the in-place sum over the group's ranks."""

    rank: int
    world: int
    all_reduce: AllReduce


def init_group(rank: int, world: int, init_addr: str) -> None:
    """Join the ranks' process group (gloo, on any device) over a TCP store."""
    dist.init_process_group("gloo", init_method=f"tcp://{init_addr}", rank=rank, world_size=world)


def gather_strings(value: str) -> list[str]:
    """Every rank's ``value``, by rank (each rank's batch socket, for rank 0 to report)."""
    out: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def agree_min(value: int) -> int:
    """The smallest ``value`` over the ranks (the KV pool's pages: every rank must hold as many)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def check_divisible(model: Any, world: int) -> None:
    """Refuse, naming the counts, a model whose heads or KV heads do not split into ``world``."""
    counts = {"attention heads": model.num_heads}
    if not getattr(model, "latent_kv", False):  # a latent pool's one row a token is on every rank
        counts["KV heads"] = model.num_kv_heads
    bad = {name: count for name, count in counts.items() if count % world}
    if bad:
        raise ValueError(f"--tp-size {world} does not divide the model's {bad}")


def shard(model: Any, rank: int, world: int) -> list[nn.Module]:
    """Keep this rank's part of every layer in place, as each layer's declared ``Split`` says (and
    1/N of each attention block's heads); returns the modules whose outputs are summed or gathered
    over the ranks (row-parallel and vocab-parallel Linears, expert-parallel experts)."""
    check_divisible(model, world)
    reduce: list[nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, AttentionLayer):
            module.split_heads(world)
        if isinstance(module, Experts):
            reduce.append(_experts(module, rank, world))
        elif isinstance(module, LatentProjection):
            _latent_heads(module, rank, world)
        elif isinstance(module, Linear):
            match module.split:
                case Split.COLUMN:
                    _columns(module, rank, world)
                case Split.ROW:
                    reduce.append(_rows(module, rank, world, name))
                case Split.VOCAB:
                    reduce.append(_vocab_rows(module, rank, world))
                case Split.REPLICATED:
                    pass
                case _:
                    raise AssertionError(f"{name}: a Linear cannot split as {module.split}")
    model.num_heads //= world
    if not getattr(model, "latent_kv", False):
        model.num_kv_heads //= world
    model.tensor_parallel = (rank, world)  # a backend's one-call paths read it (no all-reduce there)
    return reduce


def _vocab_rows(head: Linear, rank: int, world: int) -> Linear:
    """The LM head's vocabulary rows of this rank (the last rank's may be fewer): a view of the
    loaded table, so a tied embedding keeps its whole table and nothing is copied."""
    vocab = head.quantized.rows if head.quantized is not None else head.weight.shape[0]
    size = -(-vocab // world)
    start, stop = min(rank * size, vocab), min((rank + 1) * size, vocab)
    if head.quantized is not None:  # its own weight: a tied embedding keeps the whole table
        head.quantized = head.quantized.rows_of([(start, stop - start)])
    else:
        head.weight = nn.Parameter(head.weight.detach()[start:stop], requires_grad=False)
    if head.bias is not None:
        head.bias = nn.Parameter(head.bias.detach()[start:stop], requires_grad=False)
    head.vocab_span = (start, stop, vocab)
    return head


def _latent_heads(projection: LatentProjection, rank: int, world: int) -> None:
    """Latent attention's kv_b: this rank's heads' key and value rows (each head's rows contiguous)."""
    heads = projection.num_heads // world
    rows = heads * (projection.nope_dim + projection.v_dim)
    _set(projection.weight, projection.weight.detach()[rank * rows : (rank + 1) * rows].clone())
    projection.num_heads = heads


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count): rank's contiguous share of the experts, the first ``num_experts % world``
    ranks one more."""
    base, extra = divmod(num_experts, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def _experts(experts: Experts, rank: int, world: int) -> Experts:
    """Keep this rank's experts, whole: a slice of the stacked weights (or of the GGUF's blocks)."""
    first, count = expert_range(experts.routed_experts, rank, world)
    if experts.quantized is not None:
        experts.quantized = experts.quantized.experts_of(first, count)
    else:
        _set(experts.gate_up_proj, experts.gate_up_proj.detach()[first : first + count].clone())
        _set(experts.down_proj, experts.down_proj.detach()[first : first + count].clone())
    experts.first_expert, experts.num_experts = first, count
    return experts


def _part(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    if t.shape[dim] % world:
        raise ValueError(f"--tp-size {world} does not divide a projection's {t.shape[dim]} columns")
    size = t.shape[dim] // world
    return t.narrow(dim, rank * size, size).clone()


def _set(param: nn.Parameter, value: torch.Tensor) -> None:
    param.data = value


def _columns(linear: Linear, rank: int, world: int) -> None:
    """Output rows of each of a merged Linear's blocks (or of a plain one): this rank's share."""
    total = linear.quantized.rows if linear.quantized is not None else linear.weight.shape[0]
    blocks = linear.shards if isinstance(linear, MergedLinear) else {"all": (0, total)}
    parts = [(start, rows) for start, rows in blocks.values()]
    if linear.quantized is not None:  # whole rows of blocks
        if any(rows % world for _, rows in parts):
            raise ValueError(f"--tp-size {world} does not divide a projection's {parts} rows")
        mine = [(start + rank * (rows // world), rows // world) for start, rows in parts]
        linear.quantized = linear.quantized.rows_of(mine)
    else:
        _set(linear.weight, torch.cat([_part(linear.weight[s : s + r], 0, rank, world) for s, r in parts]))
    if linear.bias is not None:
        _set(linear.bias, torch.cat([_part(linear.bias[s : s + r], 0, rank, world) for s, r in parts]))
    if isinstance(linear, MergedLinear):
        linear.set_parts(list(linear.shards), [rows // world for _, rows in parts])


def _rows(linear: Linear, rank: int, world: int, name: str) -> Linear:
    """Input columns: this rank's share; the bias only on rank 0 (the sum adds it once). GGUF
    blocks: each row's blocks of those columns, which must be whole blocks (else refused)."""
    weight = linear.quantized
    if weight is None:
        _set(linear.weight, _part(linear.weight, 1, rank, world))
    else:
        cols = weight.cols
        share = cols // world
        try:
            if cols % world:
                raise ValueError(f"{cols} input columns")
            parts = tuple(part.column_span(rank * share, share) for part in weight.parts)
        except ValueError as exc:
            raise ValueError(f"--tp-size {world} cannot split {name}.weight along its input: {exc}") from exc
        linear.quantized = QuantizedWeight(parts)
    if linear.bias is not None and rank != 0:
        _set(linear.bias, torch.zeros_like(linear.bias))
    return linear


class AllReduced:
    """A row-parallel projection: this rank's partial product, summed over the ranks by ``reduce``
    (in float32 for bf16/fp16 activations), then the residual added once."""

    def __init__(self, module: Linear, reduce: AllReduce) -> None:
        self._module = module
        self._matmul = module.impl if module.impl is not None else self._plain
        self._reduce = reduce

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._module.weight, self._module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _summed(self._matmul(x), self._reduce)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)


def _summed(y: torch.Tensor, reduce: AllReduce) -> torch.Tensor:
    """``y`` summed over the ranks (in float32 for bf16/fp16)."""
    if y.dtype in (torch.float32, torch.float64) and y.is_contiguous():
        reduce(y)
        return y
    wide = y.float().contiguous()
    reduce(wide)
    return wide.to(y.dtype)


class ExpertsAllReduced:
    """An expert-parallel sparse block's experts: this rank's experts' weighted outputs (the
    backend's ``impl``, or torch's), summed over the ranks by ``reduce``; every rank reduces, even
    one no token chose an expert of this step."""

    def __init__(self, experts: Experts, reduce: AllReduce) -> None:
        self._experts = experts.impl if experts.impl is not None else experts.compute
        self._group = experts.impl.group if experts.impl is not None else ExpertGroups.of
        self._reduce = reduce

    def group(self, expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> ExpertGroups:
        return self._group(expert_ids, weights, num_experts)

    def __call__(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        if len(groups.tokens):
            y = self._experts(x, groups)
        else:
            y = x.new_zeros(groups.num_tokens, x.shape[1])
        return _summed(y, self._reduce)


class VocabGathered(AllReduced):
    """The vocab-parallel LM head: this rank's logits placed in a zeroed row of the whole
    vocabulary, summed over the ranks (so gathered: each logit is one rank's, plus zeros)."""

    def __init__(self, module: Linear, reduce: AllReduce) -> None:
        super().__init__(module, reduce)
        assert module.vocab_span is not None, "a vocab-parallel head holds its span (_vocab_rows)"
        self._span = module.vocab_span

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        part = self._matmul(x)
        start, stop, vocab = self._span
        wide = torch.float64 if part.dtype == torch.float64 else torch.float32
        logits = torch.zeros(part.shape[0], vocab, dtype=wide)
        logits[:, start:stop] = part
        self._reduce(logits)
        return logits.to(part.dtype)


def prepare_rank(model: nn.Module, tp: TensorParallel | None, prepare: Callable[[], None]) -> None:
    """Run a backend's ``prepare`` (layouts, kernels) on this rank's part of ``model``: sharded
    before, so the backend lays out only that part; the row-parallel modules' matmuls (and the
    experts' computation), whichever ``prepare`` chose, routed through ``tp.all_reduce`` after.
    Without ``tp``, ``prepare`` alone."""
    if tp is None:
        prepare()
        return
    reduced = shard(model, tp.rank, tp.world)
    prepare()
    wrap_reductions(reduced, tp.all_reduce)


def wrap_reductions(modules: list[nn.Module], reduce: AllReduce) -> None:
    """Route each row-parallel module's matmul (the backend's, or torch's) through ``reduce``, and
    the LM head's through the gather of every rank's logits."""
    for module in modules:
        if isinstance(module, Experts):
            module.attach(impl=ExpertsAllReduced(module, reduce))
        else:
            assert isinstance(module, Linear), f"{type(module).__name__} is not reduced over the ranks"
            gathered = module.split is Split.VOCAB
            module.attach(impl=(VocabGathered if gathered else AllReduced)(module, reduce))
