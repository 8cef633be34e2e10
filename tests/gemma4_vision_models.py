"""A tiny random Gemma 4 vision-language model saved with its processor (SmolLM2's tokenizer with
Gemma 4's media tokens added, Gemma 4's image processor with 4-pixel patches and a 70-token budget,
a template writing an image's ``<|image|>``), built on tests/gemma4_models.py's text model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.gemma4_models import gemma4_text_config

PATCH = 4  # pixels a patch side; pooled 3x3, so a 70-token budget is at most 630 patches
MEDIA_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|image|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def save_tiny_gemma4_vlm(
    out: Path, smollm2_dir: Path, vision: dict[str, Any] | None = None, bounds: float = 0.0
) -> tuple[Any, Any]:
    """Save the model (float64, seed 0) and its processor to ``out``; return both. ``vision``: more
    vision config; ``bounds``: clipped linears' bounds at +-(bounds + noise) (0: left infinite)."""
    import transformers
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir, extra_special_tokens=MEDIA_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Gemma4ImageProcessorPil(patch_size=PATCH, max_soft_tokens=70)
    # As transformers 5 saves a processor: its image processor's settings inside processor_config.json.
    fields = {**image_processor.to_dict(), "image_processor_type": "Gemma4ImageProcessor"}
    config_file = {"image_processor": fields, "image_seq_length": 70, "processor_class": "Gemma4Processor"}
    (out / "processor_config.json").write_text(json.dumps(config_file, indent=2))
    tokenizer.save_pretrained(out)
    processor = hf_processor(image_processor, tokenizer)
    vocab = len(tokenizer)
    ids: dict[str, Any] = {
        f"{kind}_id": tokenizer.convert_tokens_to_ids(t) for kind, t in MEDIA_TOKENS.items()
    }
    # An image's tokens see each other both ways on the sliding layers (as the released configs ask).
    text = gemma4_text_config(
        vocab_size=vocab, vocab_size_per_layer_input=vocab, use_bidirectional_attention="vision"
    ).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, patch_size=PATCH,
                  position_embedding_size=64, **(vision or {}))  # fmt: skip
    config = transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, video_token_id=vocab - 1,
        **ids,
    )  # fmt: skip
    torch.manual_seed(0)
    model: Any = transformers.Gemma4ForConditionalGeneration(config)
    model = model.to(torch.float64).eval()
    model.set_experts_implementation("eager")
    with torch.no_grad():  # random init leaves norms and scales at 1: perturb so they are tested
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "layer_scalar")):
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.add_(torch.randn_like(buffer) * 0.1)
            elif name.endswith(("std_bias", "std_scale")):
                buffer.copy_(torch.randn_like(buffer) * 0.1 + (1.0 if name.endswith("scale") else 0.0))
            elif bounds and name.endswith(("_min", "_max")):
                sign = -1.0 if name.endswith("_min") else 1.0
                buffer.fill_(sign * (bounds + 0.1 * float(torch.rand(()))))
        model.get_input_embeddings().weight.mul_(0.03)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out, safe_serialization=True)
    return model, processor


def hf_processor(image_processor: Any, tokenizer: Any) -> Any:
    """HF's Gemma4Processor without its video processor and audio feature extractor, which need
    torchvision and images do not (its constructor's type check is skipped for them)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda *_: None  # type: ignore[method-assign]
    try:
        return transformers.Gemma4Processor(
            feature_extractor=None, image_processor=image_processor, tokenizer=tokenizer,
            video_processor=None, chat_template=CHAT_TEMPLATE,
        )  # fmt: skip
    finally:
        ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]
