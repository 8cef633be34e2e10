"""gpt-oss served by the engine equals HF transformers' greedy tokens.

A tiny random gpt-oss in float64 (HF's eager experts and eager attention, which adds the sinks),
its window of 8 far shorter than the prompts (sliding and full layers alternate), YaRN rope, sinks
large enough to take a visible share of every softmax: from an HF directory in process, over
chunked prefill, mixed batches, a prefix-cache hit and n > 1.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.models.gpt_oss import ClampedSwigluExperts, GptOssForCausalLM
from tests.exactness import inprocess
from tests.exactness.test_moe import hf_greedy, runner_for

VOCAB = 500
NEW_TOKENS = 8
WINDOW = 8
PROMPT_LENS = (1, 3, 17, 40, 9, 25)


def tiny_gpt_oss_config(layers: int = 4, swiglu_limit: float = 1.5) -> Any:
    """Hidden 64, 4 heads of 16 over 2 KV heads, 8 experts of 32, top 2, window 8, YaRN x4; a clamp
    low enough for random weights to reach."""
    import transformers

    rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0}  # fmt: skip
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=layers, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=WINDOW, max_position_embeddings=256, rope_parameters=rope, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, swiglu_limit=swiglu_limit,
    )  # fmt: skip


def hf_gpt_oss(config: Any, seed: int = 0) -> Any:
    """A random float64 HF gpt-oss (eager experts and attention), norms perturbed from 1, sinks
    near the scores' size, expert biases non-zero, the clamp reached by some rows."""
    import transformers

    torch.manual_seed(seed)
    model: Any = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation="eager", attn_implementation="eager"
    )
    model = model.to(torch.float64).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(("sinks", "_bias")):
                param.copy_(torch.randn_like(param))
    return model


def make_prompts(seed: int, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(HF directory of a tiny gpt-oss, the HF reference model of the same weights)."""
    path = tmp_path_factory.mktemp("gpt_oss")
    model = hf_gpt_oss(tiny_gpt_oss_config())
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def test_layers_alternate_with_sinks(gpt_oss_dir: tuple[Path, Any]) -> None:
    path, hf = gpt_oss_dir
    runner = runner_for(path, "hf")
    model = runner.model
    assert isinstance(model, GptOssForCausalLM)
    layers: Any = model.model.layers
    assert [layer.attention.sliding_window for layer in layers] == [WINDOW, 0, WINDOW, 0]
    assert isinstance(layers[0].mlp.experts, ClampedSwigluExperts)
    torch.testing.assert_close(layers[1].self_attn.sinks, hf.model.layers[1].self_attn.sinks, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("chunk", "mixed"), [(5, True), (256, False)], ids=["chunk5-mixed", "whole-alternate"]
)
def test_greedy_matches_hf(gpt_oss_dir: tuple[Path, Any], chunk: int, mixed: bool) -> None:
    path, hf = gpt_oss_dir
    prompts = make_prompts(seed=3)
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    runner = runner_for(path, "hf")
    got, scheduler = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=chunk,
                                        enable_mixed_chunk=mixed)  # fmt: skip
    assert len({t for out in expected for t in out}) > NEW_TOKENS, "the reference must not be degenerate"
    assert got == expected
    assert scheduler.kv.used_tokens == 0, "every page must be free once all requests finished"


def test_prefix_cache_hit_and_n_choices_match_hf(gpt_oss_dir: tuple[Path, Any]) -> None:
    """Prompts sharing a 20-token prefix (past the window), admitted a few at a time (later ones hit
    the cached prefix), each asked for n = 2 greedy choices: every choice is HF's."""
    path, hf = gpt_oss_dir
    rng = random.Random(5)
    prefix = [rng.randrange(3, VOCAB) for _ in range(20)]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 11, 2)]
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    runner = runner_for(path, "hf")
    got, scheduler = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=16,
                                        enable_mixed_chunk=True, max_prefill_tokens=20, n=2)  # fmt: skip
    assert scheduler.num_cached_prompt_tokens > 0, "no prefix-cache hit"
    assert got == [e for e in expected for _ in range(2)]


def test_checkpoint_with_mxfp4_experts_matches_hf(tmp_path: Path) -> None:
    """An HF directory whose experts are MXFP4 ``*_blocks`` / ``*_scales`` (as gpt-oss ships): in
    float64, dequantized at load, HF's greedy tokens for the same values; in float32 on the C kernels,
    kept in their blocks (never widened), the tokens of their dequantized twin (--weight-dtype float32)."""
    from safetensors.torch import save_file

    from tests.gpt_oss_gguf import hf_mxfp4

    hf = hf_gpt_oss(tiny_gpt_oss_config(layers=2), seed=6)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)
                blocks, scales, held = hf_mxfp4(param.transpose(1, 2).numpy())  # [E, rows, k]
                param.copy_(torch.from_numpy(held).transpose(1, 2))
                key = f"model.layers.{i}.mlp.experts.{proj}"
                del state[key]
                state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompts = make_prompts(seed=9, lens=(4, 23))
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    got, _ = inprocess.generate(runner_for(tmp_path, "hf"), prompts, NEW_TOKENS, chunked_prefill_size=8,
                                enable_mixed_chunk=True)  # fmt: skip
    assert got == expected
    kept = runner_for(tmp_path, "hf", dtype="float32")
    twin = runner_for(tmp_path, "hf", dtype="float32", weight_dtype="float32")
    experts: Any = kept.model.model.layers[1].mlp.experts  # type: ignore[attr-defined]
    assert experts.quantized is not None and experts.gate_up_proj.numel() == 0, "kept as MXFP4 blocks"
    assert twin.model.model.layers[1].mlp.experts.quantized is None  # type: ignore[attr-defined]
    runs = [inprocess.generate(r, prompts, NEW_TOKENS, chunked_prefill_size=8, enable_mixed_chunk=True)[0]
            for r in (kept, twin)]  # fmt: skip
    assert runs[0] == runs[1]
