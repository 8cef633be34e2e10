"""A GGUF's directory holds its metadata only (config, generation config, tokenizer), never a
converted copy of its weights; an unsupported architecture stops the launcher with one line."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

import launcher
from gpu_worker.models import SUPPORTED_MODEL_TYPES
from gpu_worker.weights.gguf_config import ARCHITECTURES
from gpu_worker.weights.model_files import ModelNotSupportedError, embedded_gguf_path, resolve_model
from tokenizer_proc.gguf_tokenizer import ensure_tokenizer
from tokenizer_proc.model_info import load_tokenizer, read_model_info

TEXTS = ["Hello world", "  two spaces\tand a tab\n", "<|im_start|>user\nWhat is 2+2?<|im_end|>", "héllo ∑ 🙂"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_embedded_gguf_resolves_to_its_metadata_without_weights(cache: Path) -> None:
    model_dir = resolve_model(None)
    assert model_dir.is_relative_to(cache)
    assert sorted(f.name for f in model_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "gguf.json",
    ]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3 and config["tie_word_embeddings"] is True
    assert resolve_model(None) == model_dir  # written once
    tokenizer = load_tokenizer(str(model_dir))  # the tokenizer process builds and saves it
    written = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    assert written < 10_000_000, f"{written} bytes written for a 98 MB GGUF"
    assert not any(f.suffix == ".safetensors" for f in cache.rglob("*"))
    info = read_model_info(str(model_dir), tokenizer)
    assert (info.context_len, info.vocab_size, info.eos_token_ids) == (8192, 49152, (2,))


def test_built_tokenizer_is_the_saved_one_and_transformers_own(cache: Path) -> None:
    """What the first start tokenizes with (built in memory) equals what later starts load from the
    saved files, and what transformers builds from the GGUF itself."""
    from transformers import AutoTokenizer

    model_dir = resolve_model(None)
    built = ensure_tokenizer(model_dir)
    assert built is not None and ensure_tokenizer(model_dir) is None  # saved: not built again
    saved = AutoTokenizer.from_pretrained(str(model_dir))
    path = embedded_gguf_path()
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    for tok in (saved, theirs):
        assert [tok(t).input_ids for t in TEXTS] == [built(t).input_ids for t in TEXTS]
        assert tok.apply_chat_template(chat, tokenize=False) == built.apply_chat_template(
            chat, tokenize=False
        )
        assert (tok.eos_token_id, tok.bos_token_id) == (built.eos_token_id, built.bos_token_id)


def _write_mamba(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_stops_the_launcher_in_one_line(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ssm.gguf"
    _write_mamba(path)
    with pytest.raises(ModelNotSupportedError, match="'mamba' is not supported"):
        resolve_model(str(path))
    hf_dir = tmp_path / "bert"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "bert"}))
    for model, name in ((path, "'mamba'"), (hf_dir, "'bert'")):
        assert launcher.main(["--model", str(model), "--endpoint", f"ipc://{tmp_path}/ep"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and name in err[0], err
        listed = ARCHITECTURES if model == path else SUPPORTED_MODEL_TYPES  # a GGUF's, an HF config's
        assert f"(supported: {', '.join(listed)})" in err[0], err[0]
    assert {"llama", "qwen3moe", "gemma3", "phi3"} <= set(ARCHITECTURES)
    assert {"mistral", "qwen3_moe", "mixtral", "gemma3_text", "gpt2"} <= set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("kind", ["gemma3_text", "qwen2_yarn"])
def test_first_and_later_starts_tokenize_alike(cache: Path, tmp_path: Path, kind: str) -> None:
    """The tokenizer built on the first start (with the model type's class: GemmaTokenizer,
    Qwen2Tokenizer) and the one later starts read back from its files encode alike."""
    import transformers

    from tests.gguf_writer import write_gguf
    from tests.models import tiny_config

    config = tiny_config(kind, True)
    config.vocab_size = 49152  # SmolLM2's vocabulary, whose tokenizer fields the file gets
    write_gguf(tmp_path / "m.gguf", transformers.AutoModelForCausalLM.from_config(config),
               tokenizer_from=embedded_gguf_path())  # fmt: skip
    model_dir = resolve_model(str(tmp_path / "m.gguf"))
    first, later = load_tokenizer(str(model_dir)), load_tokenizer(str(model_dir))
    assert first is not later
    assert [first(t).input_ids for t in TEXTS] == [later(t).input_ids for t in TEXTS]
    chat = [{"role": "user", "content": "hi"}]
    assert first.apply_chat_template(chat, tokenize=False) == later.apply_chat_template(chat, tokenize=False)


def test_a_gguf_config_needs_transformers_only_for_its_rope_tables(cache: Path) -> None:
    """The worker reads a GGUF's config.json as written (GgufConfig) where its rope is plain: the
    same numbers transformers' LlamaConfig would give our model files."""
    from transformers import AutoConfig

    from gpu_worker.weights.loader import GgufConfig, load_hf_config

    model_dir = resolve_model(None)
    ours, theirs = load_hf_config(model_dir), AutoConfig.from_pretrained(str(model_dir))
    assert isinstance(ours, GgufConfig) and ours.get_text_config() is ours
    for name in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act",
                 "max_position_embeddings", "tie_word_embeddings", "rope_parameters"):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
