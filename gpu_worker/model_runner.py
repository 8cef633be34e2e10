"""Executes the scheduler's ForwardBatch: page-table deltas, one forward, sampling.

The runner decides nothing: which KV pages a request uses, how prompts are
chunked and when a token is drawn all arrive in the batch.
"""

from __future__ import annotations

import gc
import logging
import time
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from gpu_worker import backends
from gpu_worker import tensor_parallel as tp
from gpu_worker.batch_checks import BatchLimits, check_batch
from gpu_worker.config import WorkerConfig
from gpu_worker.forks import copy_pages
from gpu_worker.forward_context import BatchRows, ForwardContext
from gpu_worker.image_encoder import batch_images, image_encoder_for
from gpu_worker.kv_cache import KVPool, pool_dtype, pool_layer_shapes
from gpu_worker.models import CausalLM
from gpu_worker.models.gemma4 import adopt_media_tokens
from gpu_worker.models.layers import keep_positions
from gpu_worker.models.qwen35_positions import batch_positions
from gpu_worker.pooling import final_norm, pooled_rows, why_no_pooling
from gpu_worker.recurrent_state import begin_batch, end_batch, state_pool_for
from gpu_worker.sampling.draws import BatchDraws, Drawn
from gpu_worker.sampling.grammar import ReqPoolGrammars
from gpu_worker.sampling.head_argmax import GreedyHead
from gpu_worker.sampling.logprobs import ReqPoolTopLogprobs, prompt_logprobs
from gpu_worker.sampling.penalties import ReqPoolPenalties
from gpu_worker.sampling.sampler import ReqPoolSamplerParams
from gpu_worker.sampling.verify import DrawPlan, committed
from gpu_worker.weights.gguf_names import GgufError
from gpu_worker.weights.loader import load_model, round_weights
from protocol.messages import PENDING, ForwardBatch, ForwardResult
from protocol.transport import trim_heap

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


class ModelRunner:
    """Owns the model weights, the paged KV pool and the per-request sampling state (by req_pool_idx)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._init_device()
        self._init_model()
        gc.collect()  # loading's garbage, then its freed pages given back: the pool is not laid on them
        trim_heap()
        self._init_kv_pool()
        self.batch_limits = self._batch_limits()
        self.sampler_params = ReqPoolSamplerParams(config.max_running_requests)
        self.top_logprobs = ReqPoolTopLogprobs(config.max_running_requests)
        self.penalties = ReqPoolPenalties(
            config.max_running_requests, self.vocab_size, self._device, self._dtype
        )
        self.grammars = ReqPoolGrammars(
            config.max_running_requests, self.vocab_size, config.model_path, self.backend.host_memory
        )
        # Every per-request sampling state (indexed by req_pool_idx), told of each batch (its new
        # requests' settings, its tokens, its forks) before the forward, and the sampling step that
        # reads them.
        self.draws = BatchDraws(
            self.sampler_params, self.top_logprobs, self.penalties, self.grammars, self.backend.greedy
        )
        # The token each req_pool_idx drew last: a row scheduled before that draw came back (overlap
        # scheduling) sends PENDING as its input and gets this one. A list: the draws arrive as ints
        # (Drawn), and a step's few stores and lookups as list items cost no tensor ops.
        self.last_drawn = [0] * config.max_running_requests
        # Whether a batch whose draw is the argmax alone takes it from the head's kernel, without the
        # logits, where the model's head has one (head_argmax.py); bench.worker_step --toggle
        # head_argmax times both in one process. The model as a GreedyHead checked once here (a
        # runtime protocol's isinstance walks its members).
        self._greedy_head: GreedyHead | None = self.model if isinstance(self.model, GreedyHead) else None
        self.head_argmax = self._greedy_head is not None

    def _init_device(self) -> None:
        self.backend = backends.create(self.config)
        self._device = self.backend.device
        dtype = self.config.dtype
        if dtype == "auto":
            dtype = self.backend.auto_dtype(gguf_blocks=self._blocks_unavailable() is None)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        self._dtype = _DTYPES[dtype]

    def _init_model(self) -> None:
        started = time.perf_counter()
        self.model, self.hf_config = self._load()
        config = self.config
        tower_dtype = self.backend.tower_dtype(self._dtype) if config.dtype == "auto" else self._dtype
        self.images = image_encoder_for(config.model_path, tower_dtype, self._device, config.mmproj)
        if self.images is not None and config.gguf_path:
            adopt_media_tokens(self.model, config.gguf_path)  # Gemma 4 from a GGUF alone
        self.mrope_merge = int(getattr(self.model, "mrope_merge", 0))  # 0: 1D rope
        if not self.mrope_merge and getattr(self.model, "mrope_sections", None) and self.images is not None:
            # A GGUF's config has no vision section: the mmproj's tower says how its patches merge.
            self.mrope_merge = int(getattr(self.images.tower, "spatial_merge_size", 0))
        model = self.model
        assert isinstance(model, torch.nn.Module), "our models are nn.Modules"
        group = (
            tp.TensorParallel(config.tp_rank, config.tp_size, self.backend.all_reduce(config))
            if config.tp_size > 1
            else None
        )
        # What a sequence can reach: the model's context, bounded by the most tokens the KV pool can
        # hold (_init_kv_pool bounds it by the pool's own size). The rope's tables are cut to it
        # before the backend lays out kernels that read them (docs/benchmarks-history.md, "The worker's
        # memory at rest").
        ceiling = self.backend.kv_pool_ceiling(config.kv_cache_tokens)
        context = int(self.model.context_len)
        self._context_len = context if ceiling is None else min(context, ceiling)
        keep_positions(model, self._context_len)
        self.backend.prepare_model(model, self._dtype, group)
        self.vocab_size = int(self.hf_config.vocab_size)
        logger.info(
            "loaded %s (%s) on %s in %.1fs",
            self.config.model_path,
            self.hf_config.model_type,
            self._device,
            time.perf_counter() - started,
        )

    def _load(self) -> tuple[CausalLM, Any]:
        """The model, its weights from the GGUF with their blocks kept where --weight-dtype allows
        it (gguf_weights.py), else from the safetensors (a GGUF's conversion, bit for bit)."""
        path, dtype, device, wanted = (
            self.config.model_path,
            self._dtype,
            self._device,
            self.config.weight_dtype,
        )
        keep = self._quantized_types()
        if keep:
            try:
                return load_model(path, dtype, device, Path(self.config.gguf_path), keep)
            except GgufError as exc:
                if wanted == "gguf":
                    raise ValueError(f"--weight-dtype gguf: {exc}") from exc
                logger.info("GGUF weights dequantized: %s", exc)
        model, hf_config = load_model(path, dtype, device, keep=self._checkpoint_blocks())
        if wanted == "bfloat16" and dtype != torch.bfloat16:
            round_weights(model, torch.bfloat16)  # type: ignore[arg-type]
        return model, hf_config

    def _checkpoint_blocks(self) -> frozenset[int]:
        """The block types an HF checkpoint's packed tensors stay in (gpt-oss's MXFP4 experts:
        weights/mxfp4.py): those the backend computes on, where a GGUF's blocks would stay too."""
        usable = self.config.weight_dtype in ("auto", "gguf") and not self.config.compile
        if self.config.gguf_path or not usable or self._dtype not in (torch.float32, torch.bfloat16):
            return frozenset()
        return self.backend.quantized_types()

    def _quantized_types(self) -> frozenset[int]:
        """The GGUF block types the weights stay in: every type with a CPU kernel under
        --weight-dtype auto or gguf, where the model is a GGUF the kernels can run; none else."""
        wanted = self.config.weight_dtype
        if wanted not in ("auto", "gguf"):
            return frozenset()
        why_not = self._why_not_quantized()
        if why_not is None:
            return self.backend.quantized_types()
        if wanted == "gguf":
            raise ValueError(f"--weight-dtype gguf: {why_not}")
        if self.config.gguf_path:
            logger.info("GGUF weights dequantized: %s", why_not)
        return frozenset()

    def _why_not_quantized(self) -> str | None:
        why_not = self._blocks_unavailable()
        if why_not is None and self._dtype not in (torch.float32, torch.bfloat16):
            return f"quantized kernels take float32 or bfloat16 activations, not {self._dtype}"
        return why_not

    def _blocks_unavailable(self) -> str | None:
        """Why the weights cannot stay in GGUF blocks, whatever the activations' dtype (None: they can)."""
        if self.config.weight_dtype not in ("auto", "gguf"):
            return f"--weight-dtype {self.config.weight_dtype}"
        if not self.config.gguf_path:
            return "the model is not a GGUF file"
        if self.config.compile:
            return "--compile runs torch's matmuls"
        if not self.backend.quantized_types():
            return f"the {self.backend.name} backend has no kernels for GGUF blocks (see the log)"
        return None

    def _init_kv_pool(self) -> None:
        model = self.model
        latent = bool(getattr(model, "latent_kv", False))  # one vector a token a layer (kv_cache.py)
        kv_dtype = pool_dtype(self.config.kv_cache_dtype, self.backend, self._dtype, latent)
        elem_bytes = torch.empty((), dtype=kv_dtype).element_size()
        shapes = pool_layer_shapes(model)  # the layers that own KV (kv_cache.py)
        bytes_per_token = (1 if latent else 2) * sum(h * d for h, d in shapes) * elem_bytes
        tokens = self.backend.kv_pool_tokens(
            self.config.kv_cache_tokens, self.config.kv_mem_fraction, bytes_per_token
        )
        if self.config.tp_size > 1:  # every rank holds the same pages (its own heads of them)
            tokens = tp.agree_min(tokens)
        # The served context: no sequence outgrows the pool (WorkerReady tells the scheduler, which
        # tells the tokenizer, so a request without a limit is clamped to what can run).
        self._context_len = min(self._context_len, tokens // self.config.page_size * self.config.page_size)
        self.kv = KVPool(
            num_layers=model.num_layers,
            kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            num_pages=tokens // self.config.page_size,
            page_size=self.config.page_size,
            max_requests=self.config.max_running_requests,
            context_len=self._context_len,
            dtype=kv_dtype,
            device=self._device,
            latent=latent,
            layer_shapes=shapes,
        )
        logger.info(
            "KV pool: %d pages of %d tokens, %s (%d bytes a token%s)",
            self.kv.num_pages,
            self.kv.page_size,
            str(kv_dtype).removeprefix("torch."),
            bytes_per_token,
            ", latent" if latent else "",
        )

        config, kv_bytes = self.config, self.kv.num_pages * self.kv.page_size * bytes_per_token
        self.states = state_pool_for(
            model, config.max_running_requests, config.state_checkpoints, self._dtype, self._device, kv_bytes
        )

    def _batch_limits(self) -> BatchLimits:
        max_requests, pages_per_request = self.kv.page_table.shape
        return BatchLimits(
            max_requests=max_requests,
            pages_per_request=pages_per_request,
            num_pages=self.kv.num_pages,
            context_len=self._context_len,
            vocab_size=self.vocab_size,
            why_no_pooling=why_no_pooling(self.model),
        )

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def state_checkpoints(self) -> int:
        """A hybrid model's recurrent-state checkpoints for the prefix cache; -1: no recurrent state."""
        return -1 if self.states is None else self.states.checkpoints

    @property
    def context_len(self) -> int:
        return self._context_len

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv.k[0].dtype

    def execute(self, batch: ForwardBatch) -> ForwardResult:
        """Run one batch; return the drawn tokens of its ``sample`` rows in row order."""
        self.backend.before_batch(len(batch.req_pool_idx), len(batch.input_ids))
        started = time.perf_counter()
        with torch.inference_mode():  # once a step: forward's own decorator is for its other callers
            hidden = self._forward(batch)
            drawn = self._sample(hidden, batch)
            prompt, prompt_top = prompt_logprobs(hidden, batch, self.top_logprobs, self.model.compute_logits)
            pooled = pooled_rows(hidden, batch, final_norm(self.model)) if batch.pool else []
        forward_s = time.perf_counter() - started
        self.backend.after_batch(forward_s)
        return ForwardResult(step=batch.step, token_ids=drawn.token_ids, logprobs=drawn.logprobs,
                             forward_s=forward_s, top_logprobs=drawn.top, prompt_logprobs=prompt,
                             prompt_top_logprobs=prompt_top, pooled=pooled,
                             num_tokens=drawn.num_tokens)  # fmt: skip

    def _sample(self, hidden: torch.Tensor, batch: ForwardBatch) -> Drawn:
        """The draws of the ``sample`` rows (a verify row's at each drafted position, its kept drafts
        and draw emitted) and their forks; each drawing request's last token is kept for PENDING."""
        plan = DrawPlan.of(batch)
        if not plan.starts:
            return Drawn()
        if plan.hidden_rows != list(range(hidden.shape[0])):  # (a decode step: every row, in order)
            index = torch.tensor(plan.hidden_rows, dtype=torch.int64).to(self._device)
            hidden = hidden.index_select(0, index)
        drawn = self._greedy_in_head(hidden, plan, batch)
        if drawn is None:
            drawn = self.draws.draw(self.model.compute_logits(hidden), plan, batch)
        for idx, token in zip(drawn.last_req_pool_idx, drawn.last_tokens, strict=True):
            self.last_drawn[idx] = token
        return drawn

    def _greedy_in_head(self, hidden: torch.Tensor, plan: DrawPlan, batch: ForwardBatch) -> Drawn | None:
        """An ``argmax_alone`` batch's draws from the head's kernel, without the logits (the same
        tokens); None where the batch or the head does not take that route."""
        model = self._greedy_head
        if not (self.head_argmax and model is not None and self.draws.argmax_alone(plan, batch)):
            return None
        tokens = model.compute_argmax(hidden)
        return None if tokens is None else self.draws.argmax_drawn(tokens, plan)

    @torch.inference_mode()
    def compute_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Run ``forward`` and return the logits [rows with sample=True, vocab] at each such row's
        last token."""
        return self._sampled_logits(self.forward(batch), batch)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Apply the batch's page deltas and sampler settings, run the forward, and return the
        hidden states [tokens of the batch, hidden] (before the final norm)."""
        return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """``forward`` within the caller's inference mode."""
        check_batch(batch, self.batch_limits, self.sampler_params.assigned)  # every rule, before any use
        self.kv.apply_page_deltas(batch.req_pool_idx, batch.page_starts, batch.page_counts, batch.pages)
        positions, meta = self.backend.init_forward_metadata(
            self.kv, batch.req_pool_idx, batch.prefix_lens, batch.extend_lens
        )
        mrope = None
        if self.mrope_merge:
            positions, mrope = batch_positions(positions, batch, self.mrope_merge)
        recurrent = None if self.states is None else begin_batch(self.states, batch)
        rows = BatchRows(batch.req_pool_idx, batch.prefix_lens, batch.extend_lens, self.kv.page_table,
                         self.kv.page_size)  # fmt: skip
        ctx = ForwardContext(positions=positions, attn=meta, k_cache=self.kv.k, v_cache=self.kv.v,
                             backend=self.backend, recurrent=recurrent, rows=rows,
                             latent_form=self.config.latent_attention,
                             images=batch_images(self.images, batch), mrope=mrope)  # fmt: skip
        input_ids = self._input_ids(batch)
        view, view_ids = committed(batch, input_ids)  # a draft is no input until it is kept
        for state in self.draws.states:
            state.on_batch(view, view_ids)
        hidden = self.backend.forward_decode(input_ids, ctx) if ctx.images is None else None
        hidden = self.model(input_ids, ctx) if hidden is None else hidden
        copy_pages(self.kv, batch.copy_src, batch.copy_dst)  # a fork's own copies of prompt pages
        if self.states is not None:
            end_batch(self.states, batch)
        return hidden

    def _sampled_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ends = [
            end - 1 for end, flag in zip(accumulate(batch.extend_lens), batch.sample, strict=True) if flag
        ]
        last = torch.tensor(ends, dtype=torch.int64).to(self._device)
        return self.model.compute_logits(hidden.index_select(0, last))

    def _input_ids(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's token ids, each PENDING replaced by the token its request drew last (PENDING is
        only ever a row's last token: batch_checks)."""
        ids = batch.input_ids
        if min(ids) < 0:
            ids = list(ids)
            for i, end in enumerate(accumulate(batch.extend_lens)):
                if ids[end - 1] == PENDING:
                    ids[end - 1] = self.last_drawn[batch.req_pool_idx[i]]
        return torch.tensor(ids, dtype=torch.int64, device=self._device)
