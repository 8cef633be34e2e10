"""Every family beyond Llama's first configs, token for token against HF in float64: from an HF
directory and from a GGUF file written as llama.cpp's converter writes it (tests/gguf_writer.py).

Families: Gemma 2 (soft-capping, sliding/global layers, query_pre_attn_scalar), Gemma 3 text and
the text model of its multimodal config (QK norms, local/global rope, linear scaling), Phi-3 (fused
projections, a sliding window; LongRoPE; Phi-4-mini's partial rotary), Mistral with a sliding
window, Llama 3's rope scaling, Qwen2's YaRN, Qwen3 (QK norms) and GPT-2 (learned positions,
LayerNorm with biases, fused q/k/v written [out, in], the tied head written again). Each runs the scheduling
scenario of test_models.py (whole prompts, a prompt chunked over three batches, shared prefix
pages, decode rows mixed with extend rows). The GGUF written for a family is also read by
transformers' own GGUF loader, which must find the HF model's weights in it: the file follows
llama.cpp's conventions as transformers reads them, not only as we do.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.layers import PositionTable
from gpu_worker.weights.model_files import resolve_model
from tests.gguf_writer import write_gguf
from tests.gpu_worker.helpers import GREEDY, VOCAB, MiniScheduler, save_tiny_model
from tests.gpu_worker.test_models import hf_greedy, make_prompts, run_scenario

KINDS = [
    "gemma2",
    "gemma3_text",
    "gemma3",
    "phi3",
    "phi3_longrope",
    "phi4_mini",
    "mistral_window",
    "llama3_rope",
    "qwen2_yarn",
    "qwen3",
    "gpt2",
]
# HF runs Gemma 2 with its eager attention, whose softmax is float32 even in a float64 model.
ATOL = {"gemma2": 1e-5}
Q = gguf.GGMLQuantizationType


def _gguf_dir(gguf_file: Path, cache_dir: Path) -> Path:
    """resolve_model's directory of ``gguf_file``, written under ``cache_dir`` (not the user's
    cache; the C kernels stay built where they are)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(cache_dir))
        return resolve_model(str(gguf_file))


@pytest.fixture(scope="module", params=KINDS)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path, Any]:
    """(kind, HF dir, GGUF file, HF reference model): the HF dir and the GGUF hold the same weights
    (rounded to float32, as the F32 GGUF holds them)."""
    kind: str = request.param
    path = tmp_path_factory.mktemp(kind)
    model = save_tiny_model(kind, kind.startswith("gemma") or kind == "gpt2", path)  # as llama.cpp's are
    held = write_gguf(path / "model.gguf", model)
    model.load_state_dict(held, strict=False)
    model.save_pretrained(path, safe_serialization=True)
    return kind, path, path / "model.gguf", model


def _runner(model_path: Path, gguf_file: Path | None, page_size: int, **extra: Any) -> ModelRunner:
    config: dict[str, Any] = dict(model_path=str(model_path), dtype="float64", kv_cache_tokens=512,
                                  page_size=page_size, max_running_requests=8, num_threads=1)  # fmt: skip
    config.update(extra)
    if gguf_file is not None:  # the GGUF's own config (from its metadata), the HF dir's not read
        config.update(model_path=str(_gguf_dir(gguf_file, model_path / "cache")), gguf_path=str(gguf_file))
    return ModelRunner(WorkerConfig(**config))


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_matches_hf(family: tuple[str, Path, Path, Any], source: str) -> None:
    kind, path, gguf_file, hf = family
    if kind == "mistral_window" and source == "gguf":
        pytest.skip("Mistral's GGUFs are llama's architecture, which states no window (nor reads one)")
    runner = _runner(path, gguf_file if source == "gguf" else None, page_size=4)
    sched = MiniScheduler(runner.num_pages, 4, shuffle_seed=3)
    prompts = make_prompts(seed=len(kind))
    got = run_scenario(runner, sched, prompts, hf, atol=ATOL.get(kind, 1e-9))
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt)
    assert len({t for out in got for t in out}) > 6, "the reference must not be degenerate"


def test_transformers_reads_our_gguf_as_the_hf_model(family: tuple[str, Path, Path, Any]) -> None:
    """transformers' own GGUF loader finds the HF model's (text) weights in the file we wrote."""
    from transformers import AutoModelForCausalLM

    kind, _, gguf_file, hf = family
    if kind == "phi3_longrope":
        pytest.skip("transformers' GGUF config reader drops LongRoPE's factors; the weights are phi3's")
    if kind == "qwen3":
        pytest.skip("transformers' GGUF config reader ignores qwen3.attention.key_length (head_dim 32)")
    # GPT-2: transformers takes the vocabulary size from tokenizer fields (none here) and the
    # positions from n_ctx, which GPT2Config no longer reads: its tables are GPT-2's default sizes,
    # not the file's; every layer tensor (the transposed projections) is compared.
    resized = ("transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight") if kind == "gpt2" else ()
    theirs = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float64, ignore_mismatched_sizes=bool(resized)
    )
    ours = {k.replace("model.language_model.", "model."): v for k, v in hf.state_dict().items()}
    checked = 0
    for name, tensor in theirs.state_dict().items():
        if name in ours and name not in resized:
            torch.testing.assert_close(tensor, ours[name], rtol=0, atol=1e-6, msg=name)
            checked += 1
    assert checked >= 3 * 2 + 2, f"only {checked} tensors in common"


def test_a_pool_shorter_than_the_context_serves_the_pools_length(family: tuple[str, Path, Path, Any]) -> None:
    """--kv-cache-tokens below the model's context (256): the runner serves the pool's length (what
    WorkerReady tells the scheduler), its rope tables are cut to that many positions, and the
    scenario still matches HF token for token."""
    kind, path, _, hf = family
    runner = _runner(path, None, page_size=4, kv_cache_tokens=192)
    assert (runner.context_len, runner.model.context_len) == (192, 256)
    model = runner.model
    assert isinstance(model, torch.nn.Module)
    tables = [t for m in model.modules() if isinstance(m, PositionTable) for t in m.buffers(recurse=False)]
    assert kind == "gpt2" or tables, "every rope family has a position table"
    assert all(t.shape[0] == 192 for t in tables), [t.shape for t in tables]
    prompts = make_prompts(seed=len(kind))
    got = run_scenario(
        runner, MiniScheduler(runner.num_pages, 4, shuffle_seed=3), prompts, hf, ATOL.get(kind, 1e-9)
    )
    assert got == [hf_greedy(hf, prompt) for prompt in prompts]


def test_sliding_window_prompt_longer_than_the_window(tmp_path: Path) -> None:
    """A 100-token prompt over a 64-token window (Mistral), prefilled in chunks and whole, then
    decoded, as HF runs it: the window, not a shorter context."""
    import transformers

    from tests.models import tiny_config

    config = tiny_config("mistral", False)
    config.sliding_window = 64
    torch.manual_seed(1)
    hf: Any = transformers.MistralForCausalLM(config)
    hf = hf.to(torch.float64).eval()
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompt = [random.Random(5).randrange(VOCAB) for _ in range(100)]
    want = hf_greedy(hf, prompt)
    runner = _runner(tmp_path, None, page_size=16)
    assert runner.context_len == 256, "the window must not cap the context"
    for chunks in ([100], [40, 40, 20]):
        sched = MiniScheduler(runner.num_pages, 16)
        idx, done, got = len(chunks), 0, []
        for i, n in enumerate(chunks):
            last = i == len(chunks) - 1
            batch = sched.batch([(idx, done, prompt[done : done + n], last, GREEDY if i == 0 else None)])
            tokens = runner.execute(batch).token_ids
            done += n
        got.append(tokens[0])
        while len(got) < len(want):
            batch = sched.batch([(idx, len(prompt) + len(got) - 1, [got[-1]], True, None)])
            got.append(runner.execute(batch).token_ids[0])
        assert got == want, chunks


QUANT_TYPES = {kind: Q.Q8_0 for kind in ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate",
                                         "ffn_up", "ffn_down", "token_embd", "output")}  # fmt: skip


@pytest.mark.parametrize("kind", ["gemma3_text", "phi3", "qwen2_yarn", "gpt2"])
def test_blocks_kept_for_every_family(kind: str, tmp_path: Path) -> None:
    """A family's GGUF with Q8_0 weights keeps them in blocks (Phi-3's and GPT-2's fused q/k/v as one) and
    computes as the same file dequantized does, within the kernels' rounding of activations
    (test_gguf_weights.py's bound)."""
    model = save_tiny_model(kind, kind.startswith("gemma") or kind == "gpt2", tmp_path)
    gguf_file = tmp_path / "model.gguf"
    write_gguf(gguf_file, model, QUANT_TYPES)
    prompt = list(range(3, 300, 7))
    logits = {}
    for name, extra in (("blocks", dict(weight_dtype="gguf", dtype="float32")), ("dense", {})):
        runner = _runner(tmp_path, gguf_file, page_size=16, **extra)
        if name == "blocks":
            held = [m for m in runner.model.modules() if isinstance(getattr(m, "impl", None), QuantLinear)]  # type: ignore[attr-defined]
            assert (
                len(held) == 4 * model.config.get_text_config().num_hidden_layers + 1
            )  # qkv, o, gate_up, down; head
        batch = MiniScheduler(runner.num_pages, 16).batch([(0, 0, prompt, True, GREEDY)])
        logits[name] = runner.compute_logits(batch)[0].double()
    got, ref = logits["blocks"], logits["dense"]
    spread = float(ref.max() - ref.min())
    assert float((got - ref).abs().max()) <= 0.015 * spread, (float((got - ref).abs().max()), spread)
    assert int(got.argmax()) in set(torch.topk(ref, 2).indices.tolist())


def test_longrope_rotates_each_position_by_its_own_factors(tmp_path: Path) -> None:
    """LongRoPE (rope.py): positions below the original length rotate as HF rotates a sequence that
    fits it (short factors), positions from it as HF rotates a longer one (long factors)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from gpu_worker.models.rope import rotary_cache

    config = save_tiny_model("phi3_longrope", False, tmp_path).config
    ours = rotary_cache(config, 16, config.max_position_embeddings)
    hf = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    original = config.rope_parameters["original_max_position_embeddings"]
    for positions in (torch.arange(original), torch.arange(config.max_position_embeddings)):
        cos, sin = hf(x, positions[None])
        rows = positions[-original:] if len(positions) > original else positions
        got_cos, got_sin = ours(rows)
        want = slice(len(positions) - len(rows), None)
        torch.testing.assert_close(got_cos[:, 0], cos[0, want], rtol=0, atol=0)
        half = got_sin.shape[-1] // 2  # ours holds sin with its first half negated (layers.apply_rotary)
        torch.testing.assert_close(got_sin[:, 0, half:], sin[0, want, half:], rtol=0, atol=0)


def test_cache_retraction_and_overlap_keep_hf_tokens(family: tuple[str, Path, Path, Any]) -> None:
    """Prompts sharing 40-token prefixes (over the 16-token windows), served with the radix cache,
    chunked prefill, mixed batches and the overlap scheduler from a pool so small that cached
    prefixes are evicted and running requests retracted: HF's greedy tokens still."""
    from tests.exactness import inprocess

    kind, path, _, hf = family
    if kind in ("phi3_longrope", "phi4_mini"):
        pytest.skip("past LongRoPE's original 64 tokens HF rotates by the forward, we by position (rope.py)")
    rng = random.Random(11)
    systems = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (40, 56)]
    prompts = [
        rng.choice(systems) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(8)
    ]
    runner = _runner(path, None, page_size=4, kv_cache_tokens=1024)
    got, sched = inprocess.generate(
        runner, prompts, 12, chunked_prefill_size=16, enable_mixed_chunk=True, overlap=True,
        scheduler_overrides={"num_pages": 160 // 4, "schedule_conservativeness": 0.2},
    )  # fmt: skip
    assert sched.num_retracted > 0 and sched.num_cached_prompt_tokens > 0, "no retraction or no cache hit"
    assert sched.kv.available_pages == sched.config.num_pages, "pages leaked"
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        assert tokens == out[0, len(prompt) :].tolist(), kind
