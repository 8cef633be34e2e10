"""Gemma 4 through the one C call (csrc/decode_gemma4.c, backends/cpu/decode_gemma4*.py): a tiny random
Gemma 4 with every option the call takes on (per-layer inputs, two KV-shared layers with double-wide
MLPs, k = v on the global layers, per-layer head sizes and KV heads, proportional rope, a window,
soft-capped logits), Q8_0 blocks through the real GGUF loader, float32 activations, with global heads
of 32 or of 512 (the E4B shape's, the attention kernel's MAX_HEAD_DIM). Its decode steps run in the
call equal to the modules' bit for bit, every layer in it, or in runs between layers left on their
modules; its greedy tokens are HF float64's on the file's weights (or near-tied there)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from gpu_worker.backends.cpu.attention import KERNEL_MAX_EXTEND
from gpu_worker.backends.cpu.backend import pin_attributes
from gpu_worker.backends.cpu.decode_gemma4 import Gemma4Decode, c_layers, why_not, why_not_layer
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.gemma4 import Gemma4ForCausalLM
from tests.exactness import inprocess
from tests.exactness.test_gemma4 import NEW_TOKENS, hf_greedy, prompts
from tests.exactness.test_gemma4_gguf import gguf_runner
from tests.exactness.test_smollm2_bf16 import first_divergence_within_top2
from tests.gemma4_gguf import write_gemma4_gguf
from tests.gemma4_models import save_gemma4
from tests.gpu_worker.helpers import GREEDY, MiniScheduler, count_calls
from tests.gpu_worker.test_decode_layers import cpu_backend

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

Q8 = gguf.GGMLQuantizationType.Q8_0
KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "inp_gate", "proj")
BLOCKS = dict.fromkeys(KINDS, Q8)
# No MoE block (the call does not take one); per-layer inputs 32 wide, a whole Q8_0 block.
OPTIONS: dict[str, Any] = dict(enable_moe_block=False, hidden_size_per_layer_input=32)
SHAPES: dict[str, dict[str, Any]] = {
    "every-layer": {},
    "wide-globals": {"global_head_dim": 512},
    "tables-in-blocks": {},  # the tables and per-layer projection in Q8_0: the step's inputs in C too
}
TABLES = dict.fromkeys(("token_embd", "per_layer_token_embd", "per_layer_model_proj"), Q8)


@dataclasses.dataclass
class Tiny:
    path: Path
    hf: Any
    expected: list[list[int]]
    tables_in_blocks: bool = False


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """The HF float64 model holding the file's weights, its GGUF, and its greedy tokens."""
    path = tmp_path_factory.mktemp(f"gemma4_{request.param}")
    hf = save_gemma4(path / "hf", **OPTIONS, **SHAPES[request.param])
    tables = request.param == "tables-in-blocks"
    held = write_gemma4_gguf(path / "model.gguf", hf, BLOCKS | TABLES if tables else BLOCKS)
    hf.load_state_dict(held, strict=False)
    return Tiny(path, hf, hf_greedy(hf, prompts()[1:4]), tables)


def runner_of(tiny: Tiny, **extra: Any) -> ModelRunner:
    config: dict[str, Any] = dict(dtype="float32", kv_cache_dtype="float32", weight_dtype="gguf")
    config.update(extra)
    return gguf_runner(tiny.path, tiny.path / "model.gguf", **config)


def one_call(runner: ModelRunner) -> Gemma4Decode:
    fused = cpu_backend(runner).fused_decode
    assert isinstance(fused, Gemma4Decode), "the tiny Gemma 4 must take the one call"
    return fused


def test_layers_in_the_call(tiny: Tiny) -> None:
    """Every layer in the call, the 512-wide global ones too: layers 4 and 5 (KV-shared) read layers
    2's and 3's pool."""
    runner = runner_of(tiny)
    fused = one_call(runner)
    model: Any = runner.model
    layers = model.model.layers
    assert fused.in_c == [True] * 6
    assert [layer.self_attn.kv_slot for layer in layers] == [0, 1, 2, 3, 2, 3]
    assert layers[1].self_attn.k_eq_v and layers[1].self_attn.head_dim in (32, 512)
    narrow, wide_mlp = layers[0].mlp.gate_up_proj.sizes, layers[4].mlp.gate_up_proj.sizes
    assert list(wide_mlp) == [2 * n for n in narrow]  # a KV-shared layer's double-wide MLP


@pytest.mark.parametrize("split", [False, True], ids=["one-run", "runs"])
@pytest.mark.parametrize("rows", [1, 3])
def test_one_call_equals_the_modules(
    tiny: Tiny, rows: int, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts past the window, 20 decode steps each by the call and by the modules: equal logits.
    ``runs``: the global layers (KV-shared layer 5 and its source 3 among them) on their modules, the
    sliding ones in three runs of the call between them."""
    runner = runner_of(tiny)
    fused = one_call(runner)
    if split:
        fused = Gemma4Decode(fused.model, fused.kernels, [True, False] * 3)
        cpu_backend(runner).fused_decode = fused
    assert (fused.inputs.operands is not None) == tiny.tables_in_blocks, "the inputs in C: tables in blocks"
    calls = count_calls(fused.c_kernels, "decode", monkeypatch)
    inputs = count_calls(fused.c_kernels, "inputs", monkeypatch)
    decode_equals_the_modules(runner, fused, rows, 20, calls)
    runs = 3 if split else 1
    assert len(calls) == 20 * runs
    assert len(inputs) == (20 if tiny.tables_in_blocks else 0)


def test_media_placeholders_take_embedded(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with media placeholders: the step's inputs by ``embedded`` (which reads a placeholder
    as the pad token), not the inputs call; the layers still in the call, equal to the modules."""
    if not tiny.tables_in_blocks:
        pytest.skip("the step's inputs run in C only where the tables are in blocks")
    runner = runner_of(tiny)
    fused = one_call(runner)
    model: Any = runner.model
    model.media_token_ids = torch.tensor([5], dtype=torch.int64)  # a prompt token: the pad token read
    pin_attributes(model)  # as adopt_media_tokens sets them: before the backend pins the model's buffers
    calls = count_calls(fused.c_kernels, "decode", monkeypatch)
    inputs = count_calls(fused.c_kernels, "inputs", monkeypatch)
    decode_equals_the_modules(runner, fused, 1, 3, calls)
    assert len(calls) == 3 and not inputs


def decode_equals_the_modules(
    runner: ModelRunner, fused: Gemma4Decode, rows: int, steps: int, calls: list[int]
) -> None:
    """A prefill of ``rows`` prompts past the window (``calls``, the call's, stays empty), then
    ``steps`` decode steps each by the call and by the modules: equal logits."""
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    lens = [KERNEL_MAX_EXTEND + 5 + 7 * i for i in range(rows)]
    prefill = sched.batch([(idx, 0, list(range(3, 3 + n)), True, GREEDY) for idx, n in enumerate(lens)])
    tokens = runner.execute(prefill).token_ids
    assert not calls, "a prefill step ran the call"
    for step in range(steps):
        batch = sched.batch([(idx, lens[idx] + step, [tokens[idx]], True, None) for idx in range(rows)])
        by_call = runner.compute_logits(batch)
        cpu_backend(runner).fused_decode = None
        modules = runner.compute_logits(batch)  # the same K/V rewritten with the same values
        cpu_backend(runner).fused_decode = fused
        assert torch.equal(by_call, modules), (step, float((by_call - modules).abs().max()))
        tokens = by_call.argmax(dim=-1).tolist()


def test_greedy_matches_hf_float64(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Served (chunked prefill, mixed batches): the decode steps in the call, the tokens HF's, or
    at the first difference both in HF's top 2 (the modules' own tokens there: the wide heads' 8-bit
    activations leave a near-tie on the last step of one prompt)."""
    runner = runner_of(tiny)
    calls = count_calls(one_call(runner).c_kernels, "decode", monkeypatch)
    got, _ = inprocess.generate(
        runner, prompts()[1:4], NEW_TOKENS, chunked_prefill_size=5, enable_mixed_chunk=True
    )
    assert calls, "no decode step ran the call"
    for prompt, ours, theirs in zip(prompts()[1:4], got, tiny.expected, strict=True):
        first_divergence_within_top2(tiny.hf, prompt, ours, theirs)


def test_declines_what_it_does_not_compute(tiny: Tiny) -> None:
    """bf16 activations, a MoE block, a soft-capped attention: each keeps the modules, named."""
    runner = runner_of(tiny)
    model: Any = runner.model
    kernels = cpu_backend(runner).kernels
    assert kernels is not None
    assert isinstance(model, Gemma4ForCausalLM) and why_not(model, torch.float32) is None
    assert "activations" in (why_not(model, torch.bfloat16) or "")
    layer: Any = model.model.layers[0]
    layer.moe = True
    assert "moe=True" in (why_not_layer(layer, kernels) or "")
    layer.moe = False
    options = layer.self_attn.attention
    layer.self_attn.attention = dataclasses.replace(options, logit_softcap=50.0)
    assert "attention=" in (why_not_layer(layer, kernels) or "")
    assert not c_layers(model, kernels)[0]
    layer.self_attn.attention = options
