"""Phi-3 and Phi-4 (``phi3``): Llama's decoder, with the checkpoint's projections fused.

HF's Phi-3 holds q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (gate rows first),
which is how our Llama layers compute them anyway: the checkpoint's tensors fill those Linears
whole (``LlamaArgs.fused_checkpoint``). Its rope may be LongRoPE (rope.py), its attention
sliding-window over every layer (``sliding_window``, which Llama's decoder reads), and only
part of each head may rotate (Phi-4-mini's ``partial_rotary_factor``, which Llama's decoder reads).
"""

from __future__ import annotations

from gpu_worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM over the paged KV pool."""
