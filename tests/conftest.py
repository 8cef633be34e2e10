"""Models shared by the test suite: the embedded SmolLM2 and a tiny random Llama with its tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from gpu_worker.backends.cpu.kind import ENV_VAR, apply_to_environ

# Before anything imports torch: with RIVULET_CPU_KIND set, oneDNN, ATen and MKL act as that kind too.
ACTING_KIND = apply_to_environ()

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as an HF dir (its GGUF dequantized once per machine)."""
    from gpu_worker.weights.model_files import embedded_gguf_path
    from tests.hf_checkpoint import hf_checkpoint

    return hf_checkpoint(embedded_gguf_path())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's vocabulary and tokenizer, so real text round-trips."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    return save_with_smollm2_tokenizer(LlamaForCausalLM, tiny_config(LlamaConfig), out, smollm2_dir)


def tiny_config(config_class: Any, **extra: Any) -> Any:
    """A 2-layer, hidden-64 decoder config of ``config_class`` with SmolLM2's vocabulary."""
    return config_class(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


def save_with_smollm2_tokenizer(model_class: Any, config: Any, out: Path, smollm2_dir: Path) -> Path:
    """A random ``model_class(config)`` (seed 0) saved to ``out`` with SmolLM2's tokenizer files."""
    import torch

    torch.manual_seed(0)
    model_class(config).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, out / name)
    return out


# The kernel and exactness tests: CI runs them again as an AVX2-only CPU (pytest -m cpu_kinds).
CPU_KIND_TESTS = (
    "tests/gpu_worker/test_cpu_kernels.py",
    "tests/gpu_worker/test_cpu_matmul.py",
    "tests/gpu_worker/test_quant_kernels.py",
    "tests/gpu_worker/test_quant_k_kernels.py",
    "tests/gpu_worker/test_quant_dense.py",
    "tests/gpu_worker/test_quant_x8.py",
    "tests/gpu_worker/test_quant_a8.py",
    "tests/gpu_worker/test_quant_sub32.py",
    "tests/gpu_worker/test_quant_sub32x8.py",
    "tests/gpu_worker/test_gguf_sub32.py",
    "tests/gpu_worker/test_quant_f16.py",
    "tests/gpu_worker/test_quant_bf16x.py",
    "tests/gpu_worker/test_quant_k23.py",
    "tests/gpu_worker/test_quant_k23x8.py",
    "tests/gpu_worker/test_decode_layers.py",
    "tests/gpu_worker/test_decode_layers_windows.py",
    "tests/gpu_worker/test_decode_layers_gemma.py",
    "tests/gpu_worker/test_sink_attention.py",
    "tests/gpu_worker/test_mxfp4.py",
    "tests/gpu_worker/test_mxfp4_a8.py",
    "tests/exactness/test_gpt_oss_gguf.py",
    "tests/gpu_worker/test_gguf_weights.py",
    "tests/gpu_worker/test_models.py",
    "tests/exactness/test_families.py",
    "tests/exactness/test_prefix_cache.py",
    "tests/exactness/test_smollm2_bf16.py",
    "tests/exactness/test_smollm2_fp32.py",
    "tests/exactness/test_smollm2_gguf.py",
    "tests/exactness/test_smollm2_runner.py",
)  # not tests/exactness/test_smollm2_served.py: it starts the launcher, which the other runs cover


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the CPU_KIND_TESTS ``cpu_kinds``; under RIVULET_CPU_KIND the test ids say which kind the
    run acts as: test_x[...]@avx2."""
    acting = os.environ.get(ENV_VAR)
    for item in items:
        if item.nodeid.split("::")[0] in CPU_KIND_TESTS:
            item.add_marker(pytest.mark.cpu_kinds)
        if acting:
            item._nodeid = f"{item.nodeid}@{ACTING_KIND.value}"
