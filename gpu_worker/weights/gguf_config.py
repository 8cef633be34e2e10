"""A GGUF's metadata -> the HF config (config.json) of the model our model files build.

llama.cpp's converter writes an HF config's numbers under ``<arch>.*`` keys; some it leaves out,
and its own code knows them (Gemma's query scaling, Gemma 3's local rope base and layer pattern),
so they are restated here the way llama.cpp decides them. Rope scalings a GGUF stores as tensors
(Llama 3's ``rope_freqs``, Phi-3's ``rope_factors_long/short``) are read from the file (a few
hundred bytes each) into the config: ``rope.py`` turns them into frequencies.

One function per architecture; ``ARCHITECTURES`` is the list the launcher names when a file's
architecture is not in it. Every field our model files read is written (loader.py may read the file
without transformers' config classes, whose defaults then do not apply).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gpu_worker.weights.gguf_file import GgufHeader
from gpu_worker.weights.gguf_gemma4 import gemma4_config
from gpu_worker.weights.gguf_gpt_oss import gpt_oss_config
from gpu_worker.weights.gguf_hybrid import hybrid_config

# Llama 3's frequency factors from a GGUF's rope_freqs tensor (rope.py divides the frequencies by them).
FREQ_FACTORS_KEY = "rope_freq_factors"


class UnsupportedArchitectureError(ValueError):
    """A GGUF of an architecture we have no model for."""


def hf_config(header: GgufHeader) -> dict[str, Any]:
    """The config.json dict of ``header``'s model (raises UnsupportedArchitectureError)."""
    arch = header.architecture
    if arch not in _BUILDERS:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return _BUILDERS[arch](header)


def _key(header: GgufHeader, name: str, default: Any = None) -> Any:
    return header.metadata.get(f"{header.architecture}.{name}", default)


def _decoder(header: GgufHeader, model_type: str) -> dict[str, Any]:
    """What every decoder architecture states the same way."""
    md, key = header.metadata, lambda name, default=None: _key(header, name, default)
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    embedding = header.tensor("token_embd.weight")
    assert embedding is not None, f"{header.path} has no token_embd.weight"
    config: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": int(embedding.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": header.tensor("output.weight") is None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
    }
    _token_ids(md, config)
    window = key("attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    _rope_scaling(header, config)
    return config


def _token_ids(md: dict[str, Any], config: dict[str, Any]) -> None:
    """The file's bos, eos and padding token ids, where it states them."""
    for name in ("bos", "eos", "padding"):
        token = md.get(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token)


def _rope_scaling(header: GgufHeader, config: dict[str, Any]) -> None:
    """``<arch>.rope.scaling.*`` (linear, yarn) into rope_parameters."""
    kind = _key(header, "rope.scaling.type")
    factor = _key(header, "rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return
    params = config["rope_parameters"]
    params.update(rope_type=kind, factor=float(factor))
    if kind == "yarn":
        original = _key(header, "rope.scaling.original_context_length")
        params["original_max_position_embeddings"] = int(original or config["max_position_embeddings"])
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _key(header, f"rope.scaling.{gguf_name}")
            if value is not None:
                params[hf_name] = float(value)
    elif kind != "linear":
        raise UnsupportedArchitectureError(f"{header.path}: rope scaling {kind!r} is not supported")


def _llama(header: GgufHeader) -> dict[str, Any]:
    """Llama's architecture, which Mistral's and Mixtral's files (``expert_count``) use too."""
    mixtral = bool(_key(header, "expert_count"))
    config = _decoder(header, "mixtral" if mixtral else "llama") | {"hidden_act": "silu"}
    config.pop("sliding_window", None)  # Mistral's files: llama.cpp reads no window either
    factors = header.read_floats("rope_freqs.weight")
    if factors is not None:  # Llama 3.1+: the llama3 scaling, as llama.cpp applies it
        config[FREQ_FACTORS_KEY] = factors
    if mixtral:  # every layer sparse, its experts' size the feed-forward length; top-k renormalised
        config["num_local_experts"] = int(_key(header, "expert_count"))
        config["num_experts_per_tok"] = int(_key(header, "expert_used_count"))
    return config


def _qwen2(header: GgufHeader) -> dict[str, Any]:
    config = _decoder(header, "qwen2") | {"hidden_act": "silu"}
    config.pop("head_dim")  # Qwen2's config has none: hidden / heads
    config.pop("sliding_window", None)  # HF's Qwen slides only with use_sliding_window
    return config


def _qwen3(header: GgufHeader) -> dict[str, Any]:
    config = _decoder(header, "qwen3") | {"hidden_act": "silu"}
    config.pop("sliding_window", None)
    return config


def _qwen3moe(header: GgufHeader) -> dict[str, Any]:
    """Qwen3-MoE. Its dense layers (HF's ``mlp_only_layers``) are the ones without a router tensor;
    llama.cpp renormalises the top-k probabilities unless the file says otherwise."""
    config = _decoder(header, "qwen3_moe") | {"hidden_act": "silu", "decoder_sparse_step": 1}
    config.pop("sliding_window", None)
    layers = config["num_hidden_layers"]
    config["num_experts"] = int(_key(header, "expert_count"))
    config["num_experts_per_tok"] = int(_key(header, "expert_used_count"))
    config["moe_intermediate_size"] = int(_key(header, "expert_feed_forward_length"))
    config["norm_topk_prob"] = bool(_key(header, "expert_weights_norm", True))
    routed = {i for i in range(layers) if header.tensor(f"blk.{i}.ffn_gate_inp.weight") is not None}
    config["mlp_only_layers"] = [i for i in range(layers) if i not in routed]
    return config


def _gemma_scalar(header: GgufHeader, config: dict[str, Any], layers_27b: int) -> int:
    """query_pre_attn_scalar as llama.cpp derives it: hidden / heads for the 27B models, else head_dim
    (``attention.scale``, where a newer file states it, wins)."""
    scale = _key(header, "attention.scale")
    if scale:
        return round(1.0 / float(scale) ** 2)
    if config["num_hidden_layers"] == layers_27b:
        return int(config["hidden_size"] // config["num_attention_heads"])
    return int(config["head_dim"])


def _gemma2(header: GgufHeader) -> dict[str, Any]:
    config = _decoder(header, "gemma2")
    config["query_pre_attn_scalar"] = _gemma_scalar(header, config, layers_27b=46)
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["attn_logit_softcapping"] = _key(header, "attn_logit_softcapping")
    config["final_logit_softcapping"] = _key(header, "final_logit_softcapping")
    layers = config["num_hidden_layers"]  # HF's and llama.cpp's: even layers slide
    config["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return config


def _gemma3(header: GgufHeader) -> dict[str, Any]:
    config = _decoder(header, "gemma3_text")
    config["query_pre_attn_scalar"] = _gemma_scalar(header, config, layers_27b=62)
    config["hidden_activation"] = "gelu_pytorch_tanh"
    global_rope = config.pop("rope_parameters")
    local_theta = float(_key(header, "rope.freq_base_swa", 10000.0))  # llama.cpp's default
    config["rope_parameters"] = {
        "full_attention": global_rope,
        "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
    }
    pattern = _key(header, "attention.sliding_window_pattern")
    layers = config["num_hidden_layers"]
    if isinstance(pattern, list):  # per layer: True where it slides
        config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:  # llama.cpp's: every 6th layer global
        config["layer_types"] = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
        ]
    return config


def _phi3(header: GgufHeader) -> dict[str, Any]:
    config = _decoder(header, "phi3") | {"hidden_act": "silu"}
    rotary = _key(header, "rope.dimension_count")
    if rotary and int(rotary) != config["head_dim"]:
        config["rope_parameters"]["partial_rotary_factor"] = int(rotary) / config["head_dim"]
    long, short = (
        header.read_floats("rope_factors_long.weight"),
        header.read_floats("rope_factors_short.weight"),
    )
    if long is not None and short is not None:
        original = int(
            _key(header, "rope.scaling.original_context_length", config["max_position_embeddings"])
        )
        attention = _key(header, "rope.scaling.attn_factor")
        config["original_max_position_embeddings"] = original
        config["rope_parameters"].update(
            rope_type="longrope",
            long_factor=long,
            short_factor=short,
            original_max_position_embeddings=original,
        )
        # llama.cpp's converter writes HF's default (from the two lengths) in float32: restate it
        # only where it differs, so HF computes the default itself, in float64.
        scale = config["max_position_embeddings"] / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if attention is not None and not math.isclose(float(attention), default, rel_tol=1e-6):
            config["rope_parameters"]["attention_factor"] = float(attention)
    return config


def _gpt2(header: GgufHeader) -> dict[str, Any]:
    """GPT-2's config (learned positions, no rope): the position count is its table's rows;
    llama.cpp runs the tanh GELU, HF's ``gelu_new``. The converter writes the tied head as an
    ``output`` tensor of its own (a copy), so such a file loads untied."""
    embedding, positions = header.tensor("token_embd.weight"), header.tensor("position_embd.weight")
    assert embedding is not None and positions is not None, f"{header.path} has no token/position table"
    config: dict[str, Any] = {
        "model_type": "gpt2",
        "vocab_size": int(embedding.shape[1]),
        "n_embd": int(_key(header, "embedding_length")),
        "n_layer": int(_key(header, "block_count")),
        "n_head": int(_key(header, "attention.head_count")),
        "n_inner": int(_key(header, "feed_forward_length")),
        "n_positions": int(positions.shape[1]),
        "layer_norm_epsilon": float(_key(header, "attention.layer_norm_epsilon", 1e-5)),
        "activation_function": "gelu_new",
        "tie_word_embeddings": header.tensor("output.weight") is None,
    }
    _token_ids(header.metadata, config)
    return config


def _deepseek2(header: GgufHeader) -> dict[str, Any]:
    """DeepSeek-V2/V3 and GLM-4.7-Flash (latent attention). The converter writes the attention as
    MQA over the latent (key_length = kv_lora_rank + rope dims, one KV head) and, in newer files, the
    per-head sizes as ``key_length_mla`` / ``value_length_mla``; older ones have those in
    key_length / value_length. Sigmoid gating (V3, GLM) is DeepSeek-V3's router, softmax (V2's, the
    default of files that name none) V2's."""
    key = lambda name, default=None: _key(header, name, default)  # noqa: E731
    config = _decoder(header, "deepseek_v2") | {"hidden_act": "silu"}
    config.pop("sliding_window", None)
    nextn = int(key("nextn_predict_layers", 0))  # multi-token-prediction layers past the model's
    config["num_hidden_layers"] -= nextn
    rope, rank = int(key("rope.dimension_count")), int(key("attention.kv_lora_rank"))
    qk_head = int(key("attention.key_length_mla", key("attention.key_length")))
    config |= {
        "num_key_value_heads": config["num_attention_heads"], "head_dim": rope, "kv_lora_rank": rank,
        "q_lora_rank": key("attention.q_lora_rank"), "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk_head - rope,
        "v_head_dim": int(key("attention.value_length_mla", key("attention.value_length"))),
        "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
        # per layer, where its router is (GLM's mlp_layer_types need not be leading dense layers)
        "mlp_layer_types": [
            "sparse" if header.tensor(f"blk.{i}.ffn_gate_inp.weight") is not None else "dense"
            for i in range(config["num_hidden_layers"])
        ],
        "n_routed_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
        "n_shared_experts": int(key("expert_shared_count", 0)),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "n_group": int(key("expert_group_count", 1)), "topk_group": int(key("expert_group_used_count", 1)),
    }  # fmt: skip
    if int(key("expert_gating_func", 1)) == 2:  # sigmoid
        config |= {"model_type": "deepseek_v3", "rope_interleave": True}
    else:
        config["topk_method"] = "group_limited_greedy" if config["n_group"] > 1 else "greedy"
    log_mul = key("rope.scaling.yarn_log_multiplier")
    if log_mul and config["rope_parameters"]["rope_type"] == "yarn":  # 0.1 * mscale_all_dim
        mscale = round(float(log_mul) / 0.1, 6)  # the file holds it as float32
        config["rope_parameters"] |= {"mscale": mscale, "mscale_all_dim": mscale}
    return config


def _gpt_oss(header: GgufHeader) -> dict[str, Any]:
    key = lambda name, default=None: _key(header, name, default)  # noqa: E731
    header.metadata.setdefault("gpt-oss.feed_forward_length", key("expert_feed_forward_length"))
    return gpt_oss_config(_decoder(header, "gpt_oss"), key)


def _hybrid(header: GgufHeader) -> dict[str, Any]:
    """Qwen3.5 (dense, MoE) and Qwen3-Next: gguf_hybrid.py."""
    arch = header.architecture
    dense_size = f"{arch}.feed_forward_length"  # an MoE file may state none: its dense MLPs are the experts'
    header.metadata.setdefault(dense_size, header.metadata.get(f"{arch}.expert_feed_forward_length"))
    return hybrid_config(arch, _decoder(header, arch), lambda name, default=None: _key(header, name, default))


_BUILDERS: dict[str, Callable[[GgufHeader], dict[str, Any]]] = {
    "qwen35": _hybrid,
    "qwen35moe": _hybrid,
    "qwen3next": _hybrid,
    "deepseek2": _deepseek2,
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3moe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma4": gemma4_config,
    "phi3": _phi3,
    "gpt2": _gpt2,
    "gpt-oss": _gpt_oss,
}
ARCHITECTURES = tuple(_BUILDERS)


def generation_config(header: GgufHeader) -> dict[str, Any]:
    """generation_config.json: every token id the file says ends a turn (eos, eot, eom), as
    llama.cpp stops on any of them."""
    md = header.metadata
    ends = [md.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    config: dict[str, Any] = {"eos_token_id": list(dict.fromkeys(int(t) for t in ends if t is not None))}
    if md.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(md["tokenizer.ggml.bos_token_id"])
    return config
