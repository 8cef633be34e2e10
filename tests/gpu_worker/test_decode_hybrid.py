"""The one-call decode of a dense Qwen3.5 model (csrc/decode_hybrid.c, backends/cpu/decode_hybrid.py):
bit for bit the modules' logits and recurrent states, on decode steps only, for the models it fits."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from bench.lib.gguf_hybrid_model import SHAPES, write_model
from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.backends.cpu.decode_hybrid import HybridDecode
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import resolve_model
from protocol import ForwardBatch
from tests.exactness import inprocess
from tests.exactness.test_hybrid_prefix_cache import in_turns
from tests.gpu_worker.helpers import GREEDY, MiniScheduler, count_calls

pytestmark = [
    pytest.mark.skipif(
        shutil.which("cc") is None and shutil.which("gcc") is None,
        reason="no C compiler to build the kernels",
    ),
    pytest.mark.cpu_kinds,  # CI runs it again as an AVX2-only CPU
]

# Qwen3.5-4B's layer pattern (three Gated DeltaNet layers, then gated full attention) in the Q4_K_M
# mix, small: 2 key heads over 4 value heads, a partial rotary of 16 of 64 dims.
SMALL = dataclasses.replace(
    SHAPES["qwen35_4b"], hidden=256, layers=4, heads=2, kv_heads=1, head_dim=64, key_heads=2, value_heads=4,
    linear_dim=64, ffn=512,
)  # fmt: skip


@pytest.fixture(scope="module")
def small_qwen35(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("qwen35")
    path = write_model(out / "model.gguf", SMALL, "q4_k_m")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(out / "cache"))
        return resolve_model(str(path)), path


def runner_of(paths: tuple[Path, Path], dtype: str) -> ModelRunner:
    hf_dir, gguf_path = paths
    config = WorkerConfig(
        model_path=str(hf_dir), gguf_path=str(gguf_path), weight_dtype="gguf", dtype=dtype,
        kv_cache_tokens=2048, num_threads=1, max_running_requests=16,
    )  # fmt: skip
    return ModelRunner(config)


def backend(runner: ModelRunner) -> CpuBackend:
    assert isinstance(runner.backend, CpuBackend)
    return runner.backend


def pools(runner: ModelRunner, rows: int) -> list[torch.Tensor]:
    """The conv and recurrent states of the first ``rows`` slots (the rest never written)."""
    assert runner.states is not None
    return [t[:rows] for t in (*runner.states.conv, *runner.states.recurrent)]


@pytest.mark.parametrize("rows", [1, 3, 9], ids=["1row", "3rows", "9rows_dense"])
def test_one_call_equals_the_modules_bit_for_bit(
    small_qwen35: tuple[Path, Path], rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of different lengths, then decode steps, each run by the one call and again by the
    modules from the same states: logits and every state equal. 9 rows take the dense path of every
    Linear (set from 8 rows here). No prefill runs the one call."""
    runner = runner_of(small_qwen35, "float32")
    fused = backend(runner).fused_decode
    assert isinstance(fused, HybridDecode)
    if rows == 9:
        for module in runner.model.modules():  # type: ignore[attr-defined]
            impl = getattr(module, "impl", None)
            if impl is not None and hasattr(impl, "dense_min_rows"):
                impl.dense_min_rows = [8] * len(impl.dense_min_rows)
    calls = count_calls(fused.kernels, "decode", monkeypatch)
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    lens = [5 + 7 * i for i in range(rows)]
    prefill = sched.batch([(idx, 0, list(range(3, 3 + n)), True, GREEDY) for idx, n in enumerate(lens)])
    tokens = runner.execute(prefill).token_ids
    assert not calls, "a prefill step ran the one call"
    for step in range(12):
        batch = sched.batch([(idx, lens[idx] + step, [tokens[idx]], True, None) for idx in range(rows)])
        before = [t.clone() for t in pools(runner, rows)]
        one_call = runner.compute_logits(batch)
        after = [t.clone() for t in pools(runner, rows)]
        for pool, saved in zip(pools(runner, rows), before, strict=True):
            pool.copy_(saved)
        backend(runner).fused_decode = None
        modules = runner.compute_logits(batch)  # the same K/V rewritten, the states stepped again
        backend(runner).fused_decode = fused
        assert torch.equal(one_call, modules), (step, float((one_call - modules).abs().max()))
        assert all(torch.equal(a, b) for a, b in zip(after, pools(runner, rows), strict=True)), step
        tokens = one_call.argmax(dim=-1).tolist()
    assert len(calls) == 12


def test_bf16_runs_the_modules(small_qwen35: tuple[Path, Path]) -> None:
    """bf16 activations keep the modules (the Gated DeltaNet step's fused kernel is float32)."""
    assert backend(runner_of(small_qwen35, "bfloat16")).fused_decode is None


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_served_schedule_equals_the_modules(
    small_qwen35: tuple[Path, Path], overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the scheduler (chunked prefill of a size no prompt is a multiple of, mixed batches, two
    choices forked from one prompt, the overlap schedule): the tokens and logprobs the one call
    serves are the modules' own."""
    outputs: list[tuple[list[list[int]], list[list[float]]]] = []
    calls: list[int] = []
    sampler = msgspec.structs.replace(GREEDY, logprobs=True)
    for one_call in (True, False):
        runner = runner_of(small_qwen35, "float32")
        fused = backend(runner).fused_decode
        assert isinstance(fused, HybridDecode)
        if one_call:
            calls = count_calls(fused.kernels, "decode", monkeypatch)
        else:
            backend(runner).fused_decode = None
        logprobs: list[list[float]] = []
        got, _ = inprocess.generate(
            runner, [[5, 6, 7, 8, 9], list(range(10, 51)), [3] * 20], 8, chunked_prefill_size=13,
            enable_mixed_chunk=True, overlap=overlap, n=2, logprobs=logprobs, sampler=sampler,
        )  # fmt: skip
        outputs.append((got, logprobs))
    assert calls, "no step ran the one call"
    assert all(len(lp) == 8 for lp in outputs[0][1])
    assert outputs[0] == outputs[1]


def test_inputs_looked_up_in_the_call(small_qwen35: tuple[Path, Path]) -> None:
    """The step's embedding and rotary rows, looked up in the C call from the model's tables, equal
    the modules' lookups: logits with the embedding rows looked up by the modules and passed in (as for
    a table not in blocks) are the same; a token id past the table fails the call, not reads past it."""
    runner = runner_of(small_qwen35, "float32")
    fused = backend(runner).fused_decode
    assert isinstance(fused, HybridDecode) and fused.inputs.embed != 0
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    tokens = runner.execute(sched.batch([(0, 0, [3, 4, 5, 6, 7], True, GREEDY)])).token_ids
    states = [t.clone() for t in pools(runner, 1)]
    batch = sched.batch([(0, 5, [tokens[0]], True, None)])
    in_call = runner.compute_logits(batch)
    for pool, saved in zip(pools(runner, 1), states, strict=True):
        pool.copy_(saved)
    fused.inputs = dataclasses.replace(fused.inputs, embed=0)
    assert torch.equal(runner.compute_logits(batch), in_call)
    fused.inputs = dataclasses.replace(fused.inputs, embed=1, vocab=0)  # every id out of range
    with pytest.raises(RuntimeError, match="decode_hybrid failed"):
        runner.compute_logits(sched.batch([(0, 6, [tokens[0]], True, None)]))


@pytest.mark.parametrize("rows", [1, 3], ids=["1row", "3rows"])
def test_final_norm_in_the_call(
    small_qwen35: tuple[Path, Path], rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final norm the call computes after the layers (decode_hybrid.py's ``final``) is the norm
    module's, bit for bit: the logits and the head's argmax of the rows the call returned (which take
    its normed rows, the module not called) equal those of a copy of them (the module's norm), step
    after step; a row set the call did not return runs the module."""
    runner = runner_of(small_qwen35, "float32")
    fused, model = backend(runner).fused_decode, runner.model
    assert isinstance(fused, HybridDecode) and fused.final is not None
    norms = count_calls(model.model.norm, "forward", monkeypatch)  # type: ignore[attr-defined]
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    lens = [4 + 5 * i for i in range(rows)]
    prefill = sched.batch([(idx, 0, list(range(3, 3 + n)), True, GREEDY) for idx, n in enumerate(lens)])
    tokens = runner.execute(prefill).token_ids
    for step in range(6):
        batch = sched.batch([(idx, lens[idx] + step, [tokens[idx]], True, None) for idx in range(rows)])
        hidden = runner.forward(batch)
        assert model.normed_rows is not None and model.normed_rows[0] is hidden  # type: ignore[attr-defined]
        del norms[:]
        with torch.inference_mode():
            in_call, argmax_in_call = model.compute_logits(hidden), model.compute_argmax(hidden)  # type: ignore[attr-defined]
            assert not norms, "the rows the call returned ran the norm module"
            copy = hidden.clone()
            by_module, argmax_by_module = model.compute_logits(copy), model.compute_argmax(copy)  # type: ignore[attr-defined]
        assert len(norms) == 2
        assert torch.equal(in_call, by_module), step
        assert argmax_in_call is not None and torch.equal(argmax_in_call, argmax_by_module), step
        tokens = in_call.argmax(dim=-1).tolist()


def test_prefix_hits_equal_the_modules(small_qwen35: tuple[Path, Path]) -> None:
    """Turns served one after another on one scheduler, so later turns hit the prefix cache (a state
    checkpoint loaded) and the chunked prefill splits prompts: the tokens of the one call with its
    final norm, the one call without it (the norm module's) and the modules are the same."""
    hf_dir, gguf_path = small_qwen35
    system = [(5 * i) % 90 + 3 for i in range(23)]
    turns = [[system + [7, 8, 9]], [system + [7, 8, 9, 10, 11, 12], system + [40, 41]], [system + [50]]]
    outputs = []
    for variant in ("final norm in the call", "norm module", "modules"):
        config = WorkerConfig(
            model_path=str(hf_dir), gguf_path=str(gguf_path), weight_dtype="gguf", dtype="float32",
            page_size=4, kv_cache_tokens=2048, num_threads=1, max_running_requests=8,
        )  # fmt: skip
        runner = ModelRunner(config)
        fused = backend(runner).fused_decode
        assert isinstance(fused, HybridDecode)
        if variant == "norm module":
            fused.final = None
        elif variant == "modules":
            backend(runner).fused_decode = None
        batches: list[ForwardBatch] = []
        got, _ = in_turns(runner, turns, 7, batches)
        assert any(b.state_load_rows for b in batches), "no prefix hit loaded a checkpoint"
        outputs.append(got)
    assert outputs[0] == outputs[1] == outputs[2]
