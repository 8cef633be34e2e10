"""The layer contract (models/contract.py): tensor parallel and the backends find layers by their
declared types, roles and slots, never by attribute name; the C one-call decode admits a model by a
positive list over it, so a layer option it does not know keeps the model on its (exact) modules."""

from __future__ import annotations

import ast
import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpu_worker.backends.cpu.decode_layers import C_LAYERS, not_in_c, why_not
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models import model_class
from gpu_worker.models.contract import AttentionLayer, Layer, Split
from gpu_worker.models.llama import MLP, LlamaArgs
from gpu_worker.weights.common import parameters_on_meta
from gpu_worker.weights.model_files import source_gguf
from tests.gpu_worker.helpers import GREEDY, MiniScheduler
from tests.gpu_worker.test_decode_layers import ONE_TYPE, SMALL_QWEN3, cpu_backend, runner_of
from tests.gpu_worker.test_gguf_weights import make_random_llama

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [
    ROOT / "gpu_worker" / "tensor_parallel.py",
    *sorted((ROOT / "gpu_worker" / "backends").rglob("*.py")),
]
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)


def tiny_configs() -> dict[str, Any]:
    """One small HF config per family's model file (llama.py, moe.py, gemma.py, gpt2.py, phi3.py)."""
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Phi3Config, Qwen3MoeConfig

    shape: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
    }
    heads: dict[str, Any] = {"num_attention_heads": 4, "num_key_value_heads": 2}
    return {
        "llama": LlamaConfig(**shape, **heads),
        "qwen3_moe": Qwen3MoeConfig(
            **shape, **heads, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
        ),
        "gemma3_text": Gemma3TextConfig(**shape, **heads, head_dim=8, sliding_window=16),
        "phi3": Phi3Config(**shape, **heads, pad_token_id=0),
        "gpt2": GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    }


def build(model_type: str, cfg: Any) -> nn.Module:
    with parameters_on_meta():
        return model_class(model_type)(cfg)


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {model_type: build(model_type, cfg) for model_type, cfg in tiny_configs().items()}


def layer_attribute_names(models: dict[str, nn.Module]) -> set[str]:
    """Every name under which a model or one of its layers holds something: submodules, weights,
    kernel slots, options and counts (what a lookup by attribute name would look for)."""
    base = set(dir(nn.Module()))
    names: set[str] = set()
    for model in models.values():
        for module in model.modules():
            names |= set(vars(module)) | set(module._modules) | set(module._parameters)
            names |= {n for n in dir(type(module)) if n not in base}
    return {n for n in names if not n.startswith("__")}


def name_lookups(path: Path) -> list[tuple[int, str, str]]:
    """(line, function, name) of every hasattr/getattr/setattr/delattr call with a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id in ("hasattr", "getattr", "setattr", "delattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                found.append((node.lineno, node.func.id, name.value))
    return found


def test_tensor_parallel_and_backends_look_up_no_layer_by_attribute_name(
    models: dict[str, nn.Module],
) -> None:
    names = layer_attribute_names(models)
    # the names the code found layers by before the contract are among those the scan looks for
    assert {"qkv_proj", "gate_up_proj", "c_attn", "c_fc", "impl", "fused", "quantized", "lm_head"} <= names
    assert {"tensor_parallel", "vocab_span", "router", "layers", "model"} <= names
    planted = ROOT / "tests" / "gpu_worker" / "test_layer_contract.py"
    assert any(name == "qkv_proj" for *_, name in name_lookups(planted)), (
        "the scan sees a lookup: hasattr(m, 'qkv_proj')"
    )
    lookups = [
        f"{path.relative_to(ROOT)}:{line} {func}(..., {name!r})"
        for path in SCANNED
        for line, func, name in name_lookups(path)
        if name in names
    ]
    assert not lookups, lookups


def _planted_lookup(module: nn.Module) -> bool:  # what the scan must catch (never called)
    return hasattr(module, "qkv_proj")


def test_every_linear_declares_its_split_and_attention_its_heads(models: dict[str, nn.Module]) -> None:
    """Each family splits q/k/v (or c_attn) and gate/up (or c_fc) by columns, o and down (c_proj) by
    rows, its head over the vocabulary; a sparse block's experts by whole experts, its router whole."""
    layers = 2
    for model_type, model in models.items():
        splits = {name: m.split for name, m in model.named_modules() if isinstance(m, Layer)}
        assert splits.pop("lm_head") is Split.VOCAB, model_type
        by_split = {split: {n for n, s in splits.items() if s is split} for split in Split}
        sparse = model_type == "qwen3_moe"
        per_layer = 1 if sparse else 2  # (attention, MLP) or attention beside the experts
        assert len(by_split[Split.COLUMN]) == len(by_split[Split.ROW]) == per_layer * layers, model_type
        assert len(by_split[Split.EXPERTS]) == (layers if sparse else 0), model_type
        if sparse:
            assert {f"model.layers.{i}.mlp.gate" for i in range(layers)} <= by_split[Split.REPLICATED]
        attention = [m for m in model.modules() if isinstance(m, AttentionLayer)]
        assert len(attention) == layers, model_type


def test_attach_fills_declared_slots_only(models: dict[str, nn.Module]) -> None:
    linear = models["llama"].lm_head
    assert isinstance(linear, Layer) and linear.kernel_slots == ("impl",)
    linear.attach(impl=None)
    with pytest.raises(AssertionError, match="no kernel slot 'fused'"):
        linear.attach(fused=object())


def test_the_c_decode_lists_the_llama_and_gemma_layers_and_no_others(models: dict[str, nn.Module]) -> None:
    """The positive list: Llama's and Qwen3-MoE's layers are all on it (Phi-3's too: its layers are
    Llama's), and Gemma 3's (decode_gemma.py); GPT-2's layer types are not, so they would run their
    modules."""
    for model_type in ("llama", "qwen3_moe", "phi3", "gemma3_text"):
        for layer in models[model_type].decoder_layers():  # type: ignore[operator]
            assert not_in_c(layer) is None, model_type
    assert "GPT2Block has no C decode" in (not_in_c(models["gpt2"].decoder_layers()[0]) or "")  # type: ignore[operator]
    assert all(issubclass(t, Layer) for t in C_LAYERS)


@dataclasses.dataclass(frozen=True)
class ArgsWithANewOption(LlamaArgs):
    attention_scale: float = 1.0  # as a change to llama.py would add one


def test_a_new_model_argument_keeps_the_c_decode_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A field added to LlamaArgs that the C decode has not placed (C_ARGS) is a reason to run the
    modules, whatever the layers' options say."""
    from_hf = LlamaArgs.from_hf.__func__  # type: ignore[attr-defined]

    def with_new_option(cls: type[LlamaArgs], cfg: Any) -> LlamaArgs:
        return ArgsWithANewOption(**dataclasses.asdict(from_hf(cls, cfg)))

    plain = build("llama", tiny_configs()["llama"])
    assert "does not know" not in (why_not(plain, torch.float32) or "")
    monkeypatch.setattr(LlamaArgs, "from_hf", classmethod(with_new_option))
    model = build("llama", tiny_configs()["llama"])
    assert why_not(model, torch.float32) == "model arguments the C decode does not know: attention_scale"


def add_output_scale(monkeypatch: pytest.MonkeyPatch, scale: float) -> None:
    """A new option of Llama's MLP, as a change to llama.py would add it: its output scaled by
    ``scale``. The modules compute it; csrc/decode_layers.c knows nothing of it."""
    options, add_to = MLP.options, MLP.add_to

    def scaled_add_to(self: MLP, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + scale * (add_to(self, torch.zeros_like(residual), x))

    monkeypatch.setattr(MLP, "options", lambda self: {**options(self), "output_scale": scale})
    monkeypatch.setattr(MLP, "add_to", scaled_add_to)


@needs_cc
def test_an_option_the_c_decode_lacks_falls_back_and_stays_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same GGUF Llama takes the one call; with a new MLP option it runs its modules, whose
    decode steps follow HF's float64 logits (the option applied alike, on the GGUF's dequantized
    weights) within the blocks' rounding, far closer than the option moves them."""
    paths = make_random_llama(tmp_path, ONE_TYPE)
    assert cpu_backend(runner_of(paths, "float32")).fused_decode is not None
    add_output_scale(monkeypatch, 0.5)
    runner = runner_of(paths, "float32")
    assert cpu_backend(runner).fused_decode is None
    prompt, steps = list(range(3, 40)), 12
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    logits = [runner.compute_logits(sched.batch([(0, 0, prompt, True, GREEDY)]))[0]]
    tokens = [int(logits[-1].argmax())]
    for step in range(steps):
        logits.append(
            runner.compute_logits(sched.batch([(0, len(prompt) + step, [tokens[-1]], True, None)]))[0]
        )
        tokens.append(int(logits[-1].argmax()))
    ours = torch.stack(logits[1:]).double()
    scaled, plain = hf_logits(paths[0], monkeypatch, prompt + tokens[:-1], steps)
    error = float((ours - scaled).abs().max())
    assert error < 1e-3, error
    assert float((scaled - plain).abs().max()) > 20 * error, "the option moves the logits"


def hf_logits(
    hf_dir: Path, monkeypatch: pytest.MonkeyPatch, ids: list[int], steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's float64 logits of the last ``steps`` positions of ``ids``: with the MLP output scaled as
    ``add_output_scale`` scales ours, and without."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        plain = model(torch.tensor([ids])).logits[0, -steps:]
        forward = modeling_llama.LlamaMLP.forward
        monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: 0.5 * forward(self, x))
        scaled = model(torch.tensor([ids])).logits[0, -steps:]
    return scaled, plain


@needs_cc
def test_the_models_the_one_call_took_still_take_it(smollm2_dir: Path, tmp_path: Path) -> None:
    """The embedded SmolLM2 GGUF and a Qwen3 (Q/K norms) in the Q4_K_M mix keep the one-call decode
    (the Llama Q4_K_M shapes: test_decode_layers.py)."""
    from bench.lib import gguf_models

    gguf = source_gguf(None)
    assert gguf is not None
    config = WorkerConfig(
        model_path=str(smollm2_dir), gguf_path=str(gguf), weight_dtype="gguf", dtype="float32",
        kv_cache_tokens=256,
    )  # fmt: skip
    assert cpu_backend(ModelRunner(config)).fused_decode is not None
    path = gguf_models.write_model(tmp_path / "qwen3.gguf", SMALL_QWEN3, "q4_k_m")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
        from gpu_worker.weights.model_files import resolve_model

        hf_dir = resolve_model(str(path))
    assert cpu_backend(runner_of((hf_dir, path), "float32")).fused_decode is not None
