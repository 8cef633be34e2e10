"""Expert parallel inside ``Backend.prepare_model`` (tensor_parallel.prepare_rank): each rank keeps
only its contiguous range of a sparse block's experts (of the stacked float64 weights, or of the
GGUF's blocks), computes only the pairs routed to them, and the all-reduce it was given sums the
ranks' outputs into one rank's (within rounding: top 4, a token's terms summed per rank first).
One process: each rank's model is prepared in turn, the
all-reduce a stand-in that records what it is given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.backends.cpu.experts import QuantExperts
from gpu_worker.backends.torch.backend import TorchBackend
from gpu_worker.config import WorkerConfig
from gpu_worker.models.moe import Experts, SparseMoeBlock
from gpu_worker.tensor_parallel import ExpertsAllReduced, TensorParallel, expert_range
from gpu_worker.weights.loader import load_model
from gpu_worker.weights.model_files import resolve_model
from tests.exactness.test_moe import QUANT, hf_moe_model, tiny_moe_config
from tests.gguf_writer import write_gguf

TOKENS = 12


def test_expert_ranges_cover_every_expert_once_in_order() -> None:
    assert [expert_range(8, r, 3) for r in range(3)] == [(0, 3), (3, 3), (6, 2)]
    assert [expert_range(128, r, 2) for r in range(2)] == [(0, 64), (64, 64)]


def tp_moe_config(kind: str, top_k: int = 2) -> Any:
    """test_moe's tiny model with 6 heads and 6 KV heads of 32: o's 192 input columns are whole
    Q8_0 blocks at 2 and 3 ranks; 8 experts (3, 3, 2 at 3 ranks), each token's ``top_k``."""
    config = tiny_moe_config(kind)
    config.num_attention_heads = config.num_key_value_heads = 6
    config.head_dim, config.num_experts_per_tok = 32, top_k
    return config


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE (8 experts, top 4: a token's terms span ranks) as an HF dir and a GGUF of
    Q8_0 experts and attention."""
    path = tmp_path_factory.mktemp("tp-moe")
    config = tp_moe_config("qwen3_moe", top_k=4)
    hf = hf_moe_model(config, seed=3)
    hf.load_state_dict(write_gguf(path / "model.gguf", hf, QUANT), strict=False)
    hf.save_pretrained(path, safe_serialization=True)
    return path


def load(path: Path, source: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, torch.dtype]:
    if source == "hf":
        return load_model(path, torch.float64, torch.device("cpu"))[0], torch.float64
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(path / "cache"))
    meta = resolve_model(str(path / "model.gguf"))
    keep = CpuBackend(WorkerConfig(model_path=str(meta), num_threads=1)).quantized_types()
    return load_model(meta, torch.float32, torch.device("cpu"), path / "model.gguf", keep)[0], torch.float32


def backend_for(name: str, path: Path) -> Any:
    config = WorkerConfig(model_path=str(path), dtype="float32", num_threads=1)
    return CpuBackend(config) if name == "cpu" else TorchBackend(torch.device("cpu"))


@pytest.mark.parametrize(
    ("source", "backend_name", "world"),
    [("hf", "torch", 2), ("hf", "cpu", 3), ("gguf", "cpu", 2), ("gguf", "cpu", 3)],
)
def test_each_rank_holds_its_experts_and_the_all_reduce_sums_them(
    moe_dir: Path, source: str, backend_name: str, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    one: Any
    one, dtype = load(moe_dir, source, monkeypatch)
    backend_for(backend_name, moe_dir).prepare_model(one, dtype, None)
    block: SparseMoeBlock = one.model.layers[0].mlp
    x = torch.randn(TOKENS, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    groups = block.route(x)
    want = block.experts(x, groups)
    full = None if source == "gguf" else block.experts.gate_up_proj.detach().clone()
    routed = groups.spans[:, 0].tolist()
    partials = []
    for rank in range(world):
        sent: list[torch.Tensor] = []
        model: Any
        model, _ = load(moe_dir, source, monkeypatch)
        tp = TensorParallel(rank, world, lambda t, sent=sent: sent.append(t.clone()))  # type: ignore[misc]
        backend_for(backend_name, moe_dir).prepare_model(model, dtype, tp)
        experts: Experts = model.model.layers[0].mlp.experts
        first, count = expert_range(8, rank, world)
        assert (experts.first_expert, experts.num_experts, experts.routed_experts) == (first, count, 8)
        assert isinstance(experts.impl, ExpertsAllReduced), "the experts' output goes through the all-reduce"
        if full is not None:
            assert torch.equal(experts.gate_up_proj, full[first : first + count]), "only its experts, whole"
        else:
            inner = experts.impl._experts
            assert isinstance(inner, QuantExperts), "the blocks computed by the CPU kernels"
            assert inner.weight.num_experts == count
            assert all(
                p.rows == count * r for p, r in zip(inner.weight.projections, (32, 32, 64), strict=True)
            )
        y = model.model.layers[0].mlp.experts(x, model.model.layers[0].mlp.route(x))
        assert len(sent) == 1 and torch.equal(y, sent[0]), "one all-reduce, of this rank's output"
        chose_mine = torch.zeros(TOKENS, dtype=torch.bool)
        ids = torch.topk(torch.softmax(block.gate(x), -1, dtype=torch.float32), 4).indices
        chose_mine |= ((ids >= first) & (ids < first + count)).any(-1)
        assert torch.all(y[~chose_mine] == 0), "nothing for tokens that chose none of its experts"
        assert torch.all(y[chose_mine].abs().sum(-1) > 0), "every token that chose one has its output"
        partials.append(y)
    assert len({e * world // 8 for e in routed}) > 1, "the step's pairs span ranks"
    total = torch.zeros_like(want)
    for y in partials:  # in rank order, as both all-reduces add
        total += y
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(total, want, rtol=tol, atol=tol, msg="the ranks' sum is one rank's output")
