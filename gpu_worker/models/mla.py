"""Multi-head latent attention (MLA): DeepSeek-V2/V3 and GLM-4.7-Flash (``glm4_moe_lite``).

Each token's keys and values are one normed latent ``c`` (``kv_lora_rank``) and one rotated rope key
(``qk_rope_head_dim``) shared by every head; ``kv_b_proj`` maps the latent to each head's key
(its non-rotating part, ``W_uk``) and value (``W_uv``). The pool keeps only ``[c, k_rope]`` a token
a layer (kv_cache.py's latent pool), and attention takes one of two forms of the same sums:

- expanded: a row's latents (its prefix's read from the pool) go through ``kv_b_proj`` to per-head
  K = [c W_uk^T, k_rope] and V = c W_uv^T, then causal attention with q = [q_nope, q_rope]. The
  expansion is paid once for all of a chunk's queries: the form for prompt rows.
- absorbed: q_nope W_uk lands in latent space, so scores are [q_nope W_uk, q_rope] . [c, k_rope] and
  the output (softmax . c) W_uv^T. That is the backend's paged attention with one KV head of
  ``kv_lora_rank + qk_rope_head_dim`` dimensions whose value is the same vector (the output's trailing
  rope dimensions dropped): it reads only the pool, one latent a position for all heads, the form
  for decode rows (and the one the CPU's C kernel and Triton run).

``--latent-attention`` (``ForwardContext.latent_form``) forces either form for every row; ``auto``
takes the absorbed form for an all-decode batch and, in a batch with prompt rows, expands those and
attends its decode rows absorbed. The absorbed form adds in another order: equal within float64
rounding.

Kernel slot ``pooled_attention`` (``PooledLatentAttention``): a backend's attention of every row of
the batch over the pool, both forms, the rows' pool entries written first (backends/triton/mla.py);
empty, the absorbed all-decode batch goes to the backend's paged attention (the CPU's csrc/mla.c) and
the rest to mla_rows.py's torch.

The rope rotates the last ``qk_rope_head_dim`` dimensions of q and the shared key, as HF does by
model: DeepSeek-V2 rotates interleaved pairs in complex float32 (``complex``), DeepSeek-V3 and GLM
with ``rope_interleave`` rotate interleaved pairs and lay the result out half-split (``interleave``),
the others half-split pairs (``half``, Llama's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.forward_context import AttentionOptions, ForwardContext, paged_attention
from gpu_worker.models.contract import AttentionLayer, Layer, Split
from gpu_worker.models.layers import Linear, PositionTable, RMSNorm, apply_rotary
from gpu_worker.models.mla_rows import RowPlan, attend_rows, plan_rows
from gpu_worker.models.rope import rope_parameters

if TYPE_CHECKING:
    from gpu_worker.weights.formats import QuantBlocks

LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm and kv_a_layernorm without the config's eps


@dataclass(frozen=True)
class MlaArgs:
    hidden_size: int
    num_heads: int
    q_lora_rank: int  # 0: q straight from the hidden state (q_proj)
    kv_lora_rank: int
    nope_dim: int  # qk_nope_head_dim
    rope_dim: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim
    bias: bool  # attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj
    scale: float  # the softmax scale, YaRN's mscale folded in
    rotary: str  # complex | interleave | half

    @classmethod
    def from_hf(cls, cfg: Any) -> MlaArgs:
        nope, rope = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
        if cfg.model_type == "deepseek_v2":
            rotary = "complex"
        else:
            rotary = "interleave" if getattr(cfg, "rope_interleave", True) else "half"
        return cls(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            q_lora_rank=int(getattr(cfg, "q_lora_rank", None) or 0),
            kv_lora_rank=int(cfg.kv_lora_rank),
            nope_dim=nope,
            rope_dim=rope,
            v_dim=int(cfg.v_head_dim),
            bias=bool(getattr(cfg, "attention_bias", False)),
            scale=softmax_scale(cfg, nope + rope),
            rotary=rotary,
        )

    @property
    def latent_dim(self) -> int:
        """One pool row: the latent and the rope key."""
        return self.kv_lora_rank + self.rope_dim


def softmax_scale(cfg: Any, qk_head_dim: int) -> float:
    """1 / sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) squared where the config
    scales its rope so (DeepSeek's long-context checkpoints)."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(cfg)
    mscale_all_dim = params.get("mscale_all_dim", 0) if params["rope_type"] != "default" else 0
    factor = float(params.get("factor", 1.0))
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, rotary: str) -> torch.Tensor:
    """x [T, heads, rope_dim] rotated by its positions' cos/sin ([T, 1, rope_dim], RotaryCache's; under
    ``complex`` ComplexRotary's factors)."""
    if rotary == "half":
        return apply_rotary(x, cos, signed_sin)
    if rotary == "complex":  # HF's V2: pairs as complex float32 times ``cos`` (ComplexRotary's), cast back
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * cos).flatten(-2).to(x.dtype)
    half = x.shape[-1] // 2
    cos_h, sin_h = cos[..., :half], -signed_sin[..., :half]  # the first half of sin is stored negated
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos_h - odd * sin_h, odd * cos_h + even * sin_h), dim=-1)


class ComplexRotary(PositionTable):
    """DeepSeek-V2's rotation factors as HF makes them: ``polar(1, angle) * scaling`` in complex
    float32 for every position below ``context_len`` (torch.polar's cos and sin are not the real
    ones' bit for bit)."""

    factors: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, scaling: float, context_len: int) -> None:
        super().__init__()
        positions = torch.arange(context_len, dtype=torch.float32)
        angles = positions[:, None] * inv_freq.to(positions.device, torch.float32)[None, :]
        self.register_buffer(
            "factors", torch.polar(torch.ones_like(angles), angles) * scaling, persistent=False
        )

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> (factors [T, 1, rope_dim / 2], an unused empty sin): ``rotate``'s cos and sin."""
        return self.factors.index_select(0, positions).unsqueeze(1), self.factors.new_empty(0).real


class HeadProducts(Protocol):
    """A backend's absorbed-form products of ``LatentProjection`` (its ``heads`` slot): on a GGUF's
    k_b / v_b blocks (``quantized``), which the dense weight's bmm reads 6x the bytes of. Batches of
    more than ``max_rows`` tokens take the bmm: with many rows the products are compute, not reads."""

    max_rows: int

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor: ...

    def values(self, attended: torch.Tensor) -> torch.Tensor: ...


class LatentProjection(Layer):
    """``kv_b_proj``: each head's key (nope part) and value rows of the latent, [H (nope + v), r] as
    HF holds them. Kept as a tensor (no backend matmul layout): the absorbed form multiplies by
    its per-head blocks, or a backend's ``heads`` by a GGUF's (``quantized``: attn_k_b [H r, nope]
    and attn_v_b [H v, r], gguf_mla.py). Tensor parallel would take whole heads' rows (``Split.COLUMN``)."""

    split = Split.COLUMN
    kernel_slots = ("heads",)
    heads: HeadProducts | None = None
    quantized: tuple[QuantBlocks, QuantBlocks] | None = None

    def __init__(self, args: MlaArgs) -> None:
        super().__init__()
        self.num_heads, self.nope_dim, self.v_dim = args.num_heads, args.nope_dim, args.v_dim
        rows = args.num_heads * (args.nope_dim + args.v_dim)
        self.weight = nn.Parameter(torch.empty(rows, args.kv_lora_rank), requires_grad=False)

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, nope, r] and W_uv [H, v, r]."""
        w = self.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [L, r] -> each head's key nope part [L, H, nope] and value [L, H, v]."""
        kv = F.linear(latent, self.weight).view(latent.shape[0], self.num_heads, -1)
        return kv[..., : self.nope_dim], kv[..., self.nope_dim :]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] -> q_nope W_uk: [T, H, r]."""
        if self.heads is not None and q_nope.shape[0] <= self.heads.max_rows:
            return self.heads.absorb_query(q_nope)
        w_uk, _ = self.per_head()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def values(self, attended: torch.Tensor) -> torch.Tensor:
        """Attended latents [T, H, r] -> each head's output attended W_uv^T: [T, H, v]."""
        if self.heads is not None and attended.shape[0] <= self.heads.max_rows:
            return self.heads.values(attended)
        _, w_uv = self.per_head()
        return torch.bmm(attended.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class PooledLatentAttention(Protocol):
    """Each head's attended values [T, H, v] of the batch's tokens, ``entry`` [T, 1, r + rope] written to
    the pool first (the ``pooled_attention`` slot)."""

    def __call__(
        self, attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, entry: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor: ...  # fmt: skip


class LatentAttention(AttentionLayer):
    """One layer's MLA, HF's module names. ``num_kv_heads`` is 1: the pool's one latent row a token."""

    kernel_slots = ("pooled_attention",)
    pooled_attention: PooledLatentAttention | None = None

    def __init__(self, args: MlaArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.args = layer, args
        self.num_heads, self.num_kv_heads = args.num_heads, 1
        hidden, q_out = args.hidden_size, args.num_heads * (args.nope_dim + args.rope_dim)
        if args.q_lora_rank:
            self.q_a_proj = Linear(hidden, args.q_lora_rank, args.bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(args.q_lora_rank, q_out, False, Split.COLUMN)
        else:
            self.q_proj = Linear(hidden, q_out, False, Split.COLUMN)
        self.kv_a_proj_with_mqa = Linear(hidden, args.latent_dim, args.bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(args)
        self.o_proj = Linear(args.num_heads * args.v_dim, hidden, args.bias, Split.ROW)
        self.options_ = AttentionOptions(scale=args.scale)

    def options(self) -> dict[str, Any]:
        return {"rotary": self.args.rotary, "q_lora": bool(self.args.q_lora_rank), "scale": self.args.scale}

    def split_heads(self, world: int) -> None:
        """1/N of the heads (q's rows, kv_b's, o's columns: tensor_parallel.py); the latent and the
        rope key, one row a token for every head, stay whole on every rank."""
        assert self.num_heads % world == 0, f"{self.num_heads} heads over {world} ranks"
        self.num_heads //= world

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q's nope part [T, H, nope], its rotated rope part [T, H, rope] and the pool row [T, 1, r + rope]
        (the normed latent, the rotated rope key) of the normed hidden states ``x``."""
        a, tokens = self.args, x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if a.q_lora_rank else self.q_proj(x)
        q = q.view(tokens, self.num_heads, a.nope_dim + a.rope_dim)
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[:, : a.kv_lora_rank])
        k_rope = rotate(kv[:, None, a.kv_lora_rank :], cos, sin, a.rotary)
        q_rope = rotate(q[..., a.nope_dim :], cos, sin, a.rotary)
        return q[..., : a.nope_dim], q_rope, torch.cat((latent[:, None], k_rope), dim=-1)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext, plan: RowPlan | None
    ) -> torch.Tensor:
        """Attended rows [T, H * v] of the normed hidden states ``x`` (before o_proj); ``plan``
        (``row_plan``'s): the batch's rows attended here, else all absorbed on the backend's kernel."""
        q_nope, q_rope, entry = self.project(x, cos, sin)
        if self.pooled_attention is not None:
            out = self.pooled_attention(self, q_nope, q_rope, entry, ctx)
        elif plan is None:
            q = torch.cat((self.kv_b_proj.absorb_query(q_nope), q_rope), dim=-1)
            attended = paged_attention(self.layer, q, entry, entry, ctx, self.options_)
            out = self.kv_b_proj.values(attended[..., : self.args.kv_lora_rank])
        else:
            out = attend_rows(self, q_nope, q_rope, entry, ctx.k_cache[self.layer], plan)
        return out.flatten(1)


def row_plan(ctx: ForwardContext) -> RowPlan | None:
    """How the batch attends (``--latent-attention``): None, every row absorbed on the backend's paged
    attention (an all-decode batch under auto); else the rows' plan for the torch forms here."""
    rows, form = ctx.rows, ctx.latent_form
    if rows is None or form == "absorbed" or (form == "auto" and max(rows.extend_lens) == 1):
        return None
    return plan_rows(rows, form == "expanded", ctx.positions.device)
