"""Mixtures of experts (Qwen3-MoE, Mixtral) served by the engine equal HF transformers' greedy tokens.

Tiny random models in float64 (HF's reference runs its eager experts: its default grouped_mm refuses
float64), loaded through the real loaders from an HF directory and from a GGUF written as llama.cpp's
converter writes one (stacked ``ffn_*_exps`` tensors), over chunked prefill, mixed batches, a
prefix-cache hit and n > 1; a Qwen3-MoE with a dense layer among its sparse ones (``mlp_only_layers``);
and experts kept in their GGUF blocks, computed by the CPU kernels grouped by expert.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from gpu_worker.backends.cpu.experts import QuantExperts
from gpu_worker.backends.cpu.layouts import X8_LAYOUT
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.moe import ExpertGroups, Experts
from gpu_worker.weights.model_files import resolve_model
from tests.exactness import inprocess
from tests.gguf_writer import write_gguf

KINDS = ("qwen3_moe", "mixtral")
VOCAB = 500
NEW_TOKENS = 8
PROMPT_LENS = (1, 3, 17, 40, 9)
Q = gguf.GGMLQuantizationType


def tiny_moe_config(kind: str, dense_layers: tuple[int, ...] = ()) -> Any:
    """Hidden 64, 8 experts of 32, top 2: Qwen3-MoE (QK norms, top-k not renormalised: HF's
    default) or Mixtral (top-2 renormalised, no sliding window)."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
        num_hidden_layers=2 + len(dense_layers), num_experts_per_tok=2,
    )  # fmt: skip
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, norm_topk_prob=False,
            mlp_only_layers=list(dense_layers), **common,
        )  # fmt: skip
    return transformers.MixtralConfig(
        intermediate_size=32, num_local_experts=8, sliding_window=None, **common
    )


def hf_moe_model(config: Any, seed: int = 0) -> Any:
    """A random float64 HF model of ``config`` (its eager experts), norms perturbed from 1."""
    import transformers

    torch.manual_seed(seed)
    model: Any = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    model = model.to(torch.float64).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def make_prompts(seed: int, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lens]


def runner_for(path: Path, source: str, page_size: int = 4, **extra: Any) -> ModelRunner:
    """A float64 runner of the HF dir, or of its GGUF (its config from the file's metadata)."""
    config: dict[str, Any] = dict(model_path=str(path), dtype="float64", page_size=page_size,
                                  kv_cache_tokens=1024, num_threads=1)  # fmt: skip
    if source == "gguf":
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RIVULET_CACHE_DIR", str(path / "cache"))
            config["model_path"] = str(resolve_model(str(path / "model.gguf")))
        config["gguf_path"] = str(path / "model.gguf")
    config.update(extra)
    return ModelRunner(WorkerConfig(**config))


@pytest.fixture(scope="module", params=KINDS)
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(dir holding the HF checkpoint and model.gguf of the same weights, HF reference model)."""
    path = tmp_path_factory.mktemp(request.param)
    model = hf_moe_model(tiny_moe_config(request.param))
    held = write_gguf(path / "model.gguf", model)  # F32: the HF weights rounded to float32
    model.load_state_dict(held, strict=False)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize(
    ("chunk", "mixed"), [(5, True), (256, False)], ids=["chunk5-mixed", "whole-alternate"]
)
def test_greedy_matches_hf(moe_model: tuple[Path, Any], source: str, chunk: int, mixed: bool) -> None:
    path, hf = moe_model
    prompts = make_prompts(seed=3)
    expected = hf_greedy(hf, prompts)
    runner = runner_for(path, source)
    got, scheduler = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=chunk,
                                        enable_mixed_chunk=mixed)  # fmt: skip
    assert len({t for out in expected for t in out}) > NEW_TOKENS, "the reference must not be degenerate"
    assert got == expected
    assert scheduler.kv.used_tokens == 0, "every page must be free once all requests finished"


def test_prefix_cache_hit_and_n_choices_match_hf(moe_model: tuple[Path, Any]) -> None:
    """Prompts sharing a 24-token prefix, admitted a few at a time (later ones hit the cached
    prefix), each asked for n = 2 greedy choices: every choice is HF's greedy continuation."""
    path, hf = moe_model
    rng = random.Random(5)
    prefix = [rng.randrange(3, VOCAB) for _ in range(24)]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 11, 2)]
    expected = hf_greedy(hf, prompts)
    runner = runner_for(path, "gguf")
    got, scheduler = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=16,
                                        enable_mixed_chunk=True, max_prefill_tokens=20, n=2)  # fmt: skip
    assert scheduler.num_cached_prompt_tokens > 0, "no prefix-cache hit"
    assert got == [e for e in expected for _ in range(2)]


def test_dense_layers_among_sparse_ones(tmp_path: Path) -> None:
    """Qwen3-MoE whose middle layer is dense (``mlp_only_layers``) runs Llama's MLP there."""
    hf = hf_moe_model(tiny_moe_config("qwen3_moe", dense_layers=(1,)), seed=1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = make_prompts(seed=4)
    runner = runner_for(tmp_path, "hf")
    layers: Any = runner.model.model.layers  # type: ignore[attr-defined]
    assert [isinstance(getattr(layer.mlp, "experts", None), Experts) for layer in layers] == [
        True,
        False,
        True,
    ]
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=7, enable_mixed_chunk=True)
    assert got == hf_greedy(hf, prompts)


def test_grouped_experts_equal_each_token_alone() -> None:
    """The experts grouped by expert give each token what its own k experts give it, summed."""
    torch.manual_seed(0)
    experts = Experts(num_experts=6, hidden=16, inner=8, act="silu").double()
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(9, 16, dtype=torch.float64)
    ids = torch.stack([torch.randperm(6)[:3] for _ in range(9)])
    weights = torch.rand(9, 3, dtype=torch.float64)
    groups = ExpertGroups.of(ids, weights, 6)
    assert [count for _, _, count in groups.spans.tolist()] == torch.bincount(ids.flatten(), minlength=6)[
        torch.bincount(ids.flatten(), minlength=6) > 0
    ].tolist()
    want = torch.zeros_like(x)
    for t in range(9):
        for j in range(3):
            gate, up = (experts.gate_up_proj[ids[t, j]] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (experts.down_proj[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts(x, groups), want, rtol=1e-12, atol=1e-12)


QUANT = {kind: Q.Q8_0 for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_q", "attn_k",
                                    "attn_v", "attn_output")}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_experts_kept_in_blocks(kind: str, tmp_path: Path) -> None:
    """Q8_0 experts stay in their blocks (QuantExperts, the CPU kernels over rows grouped by
    expert) and give HF's greedy tokens on the file's dequantized weights."""
    hf = hf_moe_model(tiny_moe_config(kind), seed=2)
    hf.load_state_dict(write_gguf(tmp_path / "model.gguf", hf, QUANT), strict=False)
    runner = runner_for(tmp_path, "gguf", page_size=16, dtype="float32", weight_dtype="gguf")
    impls = [m.impl for m in runner.model.modules() if isinstance(m, Experts)]  # type: ignore[attr-defined]
    assert len(impls) == 2 and all(isinstance(impl, QuantExperts) for impl in impls)
    # every re-laid block tensor, the experts' and the attention's, in the one huge-page arena
    held = [w for m in runner.model.modules() if (w := getattr(m, "quantized", None)) is not None]  # type: ignore[attr-defined]
    relaid = [
        p.data for w in held for p in getattr(w, "parts", None) or w.projections if p.layout == X8_LAYOUT
    ]
    assert len(relaid) >= 2 * 3 and len({t.untyped_storage().data_ptr() for t in relaid}) == 1
    prompts = make_prompts(seed=6)
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=16, enable_mixed_chunk=True)
    assert got == hf_greedy(hf, prompts)


def test_transformers_reads_our_qwen3moe_gguf(moe_model: tuple[Path, Any]) -> None:
    """transformers' own GGUF loader finds the HF model's weights in the Qwen3-MoE file we wrote
    (its router, its stacked experts): the file follows llama.cpp's conventions as transformers
    reads them. (Given the HF config: transformers' GGUF config reader ignores
    ``expert_feed_forward_length`` and takes Qwen3-MoE's default expert size.)"""
    from transformers import AutoModelForCausalLM

    path, hf = moe_model
    if hf.config.model_type != "qwen3_moe":
        pytest.skip("transformers reads no mixture of experts from llama's architecture (Mixtral's files)")
    theirs = AutoModelForCausalLM.from_pretrained(
        path, gguf_file="model.gguf", config=hf.config, dtype=torch.float64
    )
    ours = hf.state_dict()
    checked = [
        name for name in theirs.state_dict() if name in ours and ("experts" in name or ".mlp.gate." in name)
    ]
    for name in checked:
        torch.testing.assert_close(theirs.state_dict()[name], ours[name], rtol=0, atol=1e-6, msg=name)
    assert len(checked) >= 3 * 2, checked
