"""Executes the scheduler's ForwardBatch: page-table deltas, one forward, sampling.

The runner decides nothing: which KV pages a request uses, how prompts are
chunked and when a token is drawn all arrive in the batch.
"""

from __future__ import annotations

import logging
import os
import time
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpu_worker import tensor_parallel as tp
from gpu_worker.backends.cpu import backend as cpu_backend
from gpu_worker.backends.cpu.shm_allreduce import pick_all_reduce
from gpu_worker.backends.cpu.threads import ThreadTuner, shape_class
from gpu_worker.backends.torch_ref.attention import ForwardContext, build_metadata
from gpu_worker.batch_checks import check_batch
from gpu_worker.config import WorkerConfig
from gpu_worker.forks import check_forks, copy_pages, with_forks
from gpu_worker.kv_cache import KVPool, kv_pool_tokens
from gpu_worker.models import CausalLM
from gpu_worker.sampling.grammar import SlotGrammars
from gpu_worker.sampling.logprobs import (
    SlotTopLogprobs,
    asked_logprobs,
    check_logprob_fields,
    prompt_logprobs,
)
from gpu_worker.sampling.penalties import SlotPenalties
from gpu_worker.sampling.sampler import SlotSamplerParams, greedy_pick, sample
from gpu_worker.weights.gguf_weights import GgufError
from gpu_worker.weights.loader import load_model, round_weights
from protocol.logprobs import TopTokens
from protocol.messages import PENDING, ForwardBatch, ForwardResult

if TYPE_CHECKING:
    from gpu_worker.backends.cpu.decode_layers import FusedDecode

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


class ModelRunner:
    """Owns the model weights, the paged KV pool and per-slot sampler settings."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._init_device()
        self._init_model()
        self._init_kv_pool()
        self.sampler_params = SlotSamplerParams(config.max_running_requests)
        self.top_logprobs = SlotTopLogprobs(config.max_running_requests)
        self.penalties = SlotPenalties(
            config.max_running_requests, self.vocab_size, self._device, self._dtype
        )
        self.grammars = SlotGrammars(config.max_running_requests, self.vocab_size, config.model_path)
        # The token each slot drew last: a row scheduled before that draw came back (overlap
        # scheduling) sends PENDING as its input and gets this one.
        self.last_tokens = torch.zeros(config.max_running_requests, dtype=torch.int64, device=self._device)

    def _init_device(self) -> None:
        name = self.config.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(name)
        self._tuner: ThreadTuner | None = None
        if self._device.type == "cpu":
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            torch.set_num_threads(self.config.num_threads or cores)
            if self.config.tune_threads and self.config.num_threads == 0 and cores > 1:
                self._tuner = ThreadTuner((cores, max(1, cores // 2)))
        dtype = self.config.dtype
        if dtype == "auto":
            dtype = auto_dtype(self._device, gguf_blocks=self._blocks_unavailable() is None)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        self._dtype = _DTYPES[dtype]

    def _init_model(self) -> None:
        started = time.perf_counter()
        self.model, self.hf_config = self._load()
        if self.config.tp_size > 1:  # this rank's share of every layer, then the backend readies it
            reduced = tp.shard(self.model, self.config.tp_rank, self.config.tp_size)
            self._prepare_kernels()
            tp.wrap_reductions(reduced, pick_all_reduce(self.config, self._device))
        else:
            self._prepare_kernels()
        self._context_len = int(self.model.context_len)
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
        model, hf_config = load_model(path, dtype, device)
        if wanted == "bfloat16" and dtype != torch.bfloat16:
            round_weights(model, torch.bfloat16)  # type: ignore[arg-type]
        return model, hf_config

    def _quantized_types(self) -> frozenset[int]:
        """The GGUF block types the weights stay in: every type with a CPU kernel under
        --weight-dtype auto or gguf, where the model is a GGUF the kernels can run; none else."""
        wanted = self.config.weight_dtype
        if wanted not in ("auto", "gguf"):
            return frozenset()
        why_not = self._why_not_quantized()
        if why_not is None:
            return cpu_backend.quantized_types(self.config.cpu_kernels)
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
        if self.config.tp_size > 1:
            return "--tp-size splits dequantized weights"
        if self.config.weight_dtype not in ("auto", "gguf"):
            return f"--weight-dtype {self.config.weight_dtype}"
        if not self.config.gguf_path:
            return "the model is not a GGUF file"
        if self._device.type != "cpu":
            return f"quantized kernels exist for CPU only, not {self._device.type}"
        if self.config.compile:
            return "--compile runs torch's matmuls"
        if not cpu_backend.quantized_types(self.config.cpu_kernels):
            return "the CPU's C kernels are off or could not be built (see the log)"
        return None

    def _prepare_kernels(self) -> None:
        """--compile: torch.compile every layer's forward; on CPU, the CPU backend readies the model
        (kernels, matmul paths and weight layouts per CPU kind: gpu_worker/backends/cpu/backend.py)."""
        model = self.model
        assert isinstance(model, torch.nn.Module), "our models are nn.Modules"
        if self.config.compile:
            layers = getattr(getattr(model, "model", None), "layers", None)
            if layers is None:
                logger.warning(
                    "--compile: %s has no layers to compile; running eagerly", type(model).__name__
                )
            else:
                for layer in layers:
                    layer.compile(dynamic=True)
        self._kernels = None
        self.fused_decode: FusedDecode | None = None  # all decoder layers in one call, on decode steps
        if self._device.type == "cpu":
            setup = cpu_backend.prepare_model(
                model, self._dtype, self.config.cpu_kernels, self.config.compile
            )
            self._kernels = setup.kernels
            self.fused_decode = setup.decode_layers

    def _init_kv_pool(self) -> None:
        model = self.model
        elem_bytes = torch.empty((), dtype=self._dtype).element_size()
        bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * elem_bytes
        tokens = kv_pool_tokens(
            self.config.kv_cache_tokens, self.config.kv_mem_fraction, bytes_per_token, self._device
        )
        if self.config.tp_size > 1:  # every rank holds the same pages (its own heads of them)
            tokens = tp.agree_min(tokens)
        self.kv = KVPool(
            num_layers=model.num_layers,
            kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            num_pages=tokens // self.config.page_size,
            page_size=self.config.page_size,
            max_requests=self.config.max_running_requests,
            context_len=self._context_len,
            dtype=self._dtype,
            device=self._device,
        )
        logger.info("KV pool: %d pages of %d tokens", self.kv.num_pages, self.kv.page_size)

    @property
    def uses_cpu_kernels(self) -> bool:
        """Whether decode rows are attended by our C kernel (else by torch)."""
        return self._kernels is not None

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def context_len(self) -> int:
        return self._context_len

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def execute(self, batch: ForwardBatch) -> ForwardResult:
        """Run one batch; return the drawn tokens of its ``sample`` rows in row order."""
        shape = shape_class(len(batch.slots), len(batch.input_ids))
        threads = self._use_threads(shape)
        started = time.perf_counter()
        hidden = self.forward(batch)
        with torch.inference_mode():
            token_ids, logprobs, top = self._sample(hidden, batch)
            prompt, prompt_top = prompt_logprobs(hidden, batch, self.top_logprobs, self.model.compute_logits)
        forward_s = time.perf_counter() - started
        if self._tuner is not None:
            self._tuner.record(shape, threads, forward_s)
        return ForwardResult(step=batch.step, token_ids=token_ids, logprobs=logprobs, forward_s=forward_s,
                             top_logprobs=top, prompt_logprobs=prompt,
                             prompt_top_logprobs=prompt_top)  # fmt: skip

    def _sample(
        self, hidden: torch.Tensor, batch: ForwardBatch
    ) -> tuple[list[int], list[float], list[TopTokens]]:
        """The tokens drawn for the ``sample`` rows, their logprobs where asked (else []), and their
        top-N where some row asked (else [])."""
        rows = [i for i, flag in enumerate(batch.sample) if flag]
        if not rows:
            return [], [], []
        logits = self._sampled_logits(hidden, batch)
        slots = [batch.slots[i] for i in rows]
        positions = [batch.prefix_lens[i] + batch.extend_lens[i] for i in rows]
        logits, slots, positions = with_forks(logits, slots, positions, rows, batch)
        logits = self.penalties.apply(logits, slots, positions)  # before greedy's argmax too
        # The grammar mask after the penalties: greedy and sampled rows draw from the masked logits,
        # and a grammar row's logprobs are those of the masked distribution, the one it was drawn from.
        logits = self.grammars.apply(logits, slots)
        greedy = self.sampler_params.plain_greedy(slots)
        if greedy:
            tokens, token_logprobs = greedy_pick(logits, self._kernels), None
        else:
            params = self.sampler_params.batch(slots, positions, self._device)
            tokens, token_logprobs = sample(logits, params)
        self.last_tokens[torch.tensor(slots, device=self._device)] = tokens
        logprobs = token_logprobs.tolist() if token_logprobs is not None else []
        want = [self.sampler_params.logprobs[s] for s in slots]
        top: list[TopTokens] = []
        # Greedy rows' logprobs, and top-N (with the chosen token's logprob from the same normalizer,
        # so the two are bit-equal), for the rows that asked only; top_logprobs > 0 implies logprobs.
        if self.top_logprobs.wants_top(slots) or (greedy and any(want)):
            top_n = [self.top_logprobs.top_n[s] for s in slots]
            logprobs, top = asked_logprobs(logits, tokens, want, top_n, logprobs)
        return tokens.tolist(), logprobs, top

    def _use_threads(self, shape: tuple[str, int]) -> int:
        """Set the torch thread count the tuner picks for this batch's shape class."""
        if self._tuner is None:
            return torch.get_num_threads()
        threads = self._tuner.choose(shape)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads

    @torch.inference_mode()
    def compute_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Run ``forward`` and return the logits [rows with sample=True, vocab] at each such row's
        last token."""
        return self._sampled_logits(self.forward(batch), batch)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Apply the batch's page deltas and sampler settings, run the forward, and return the
        hidden states [tokens of the batch, hidden] (before the final norm)."""
        check_batch(batch, self.kv.num_pages, self.kv.page_table.shape, self._context_len, self.vocab_size)
        check_logprob_fields(batch, self.vocab_size)
        check_forks(batch, self.kv.page_table.shape[0], self.kv.num_pages)
        self.kv.apply_page_deltas(batch.slots, batch.page_starts, batch.page_counts, batch.pages)
        for slots, samplers in ((batch.slots, batch.sampler), (batch.fork_slots, batch.fork_samplers)):
            self.sampler_params.update(slots, samplers)
            self.top_logprobs.update(slots, samplers)
        positions, meta = build_metadata(
            self.kv.page_table,
            self.kv.page_size,
            batch.slots,
            batch.prefix_lens,
            batch.extend_lens,
            self._device,
            self._kernels,
        )
        ctx = ForwardContext(positions=positions, attn=meta, k_cache=self.kv.k, v_cache=self.kv.v)
        input_ids = self._input_ids(batch)
        self.penalties.update(batch, input_ids)
        self.grammars.update(batch, input_ids)
        if batch.fork_rows:  # n > 1: the forks' slots start from their parents' prompt state
            fork_parents = [batch.slots[i] for i in batch.fork_rows]
            self.penalties.fork(fork_parents, batch.fork_slots, batch.fork_samplers)
            self.grammars.fork(batch.fork_slots, batch.fork_samplers)
        hidden = self.fused_decode(input_ids, ctx) if self.fused_decode is not None else None
        hidden = self.model(input_ids, ctx) if hidden is None else hidden
        copy_pages(self.kv, batch.copy_src, batch.copy_dst)  # a fork's own copies of prompt pages
        return hidden

    def _sampled_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ends = [
            end - 1 for end, flag in zip(accumulate(batch.extend_lens), batch.sample, strict=True) if flag
        ]
        last = torch.tensor(ends, dtype=torch.int64).to(self._device)
        return self.model.compute_logits(hidden.index_select(0, last))

    def _input_ids(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's token ids, each PENDING replaced by the token its slot drew last."""
        input_ids = torch.tensor(batch.input_ids, dtype=torch.int64).to(self._device)
        if min(batch.input_ids) >= 0:
            return input_ids
        ends = list(accumulate(batch.extend_lens))
        rows = [i for i, end in enumerate(ends) if batch.input_ids[end - 1] == PENDING]
        where = torch.tensor([ends[i] - 1 for i in rows], device=self._device)
        slots = torch.tensor([batch.slots[i] for i in rows], device=self._device)
        input_ids[where] = self.last_tokens[slots]
        return input_ids


def auto_dtype(device: torch.device, gguf_blocks: bool = False) -> str:
    """bfloat16 on CUDA; on CPU what the CPU backend picks for the CPU kind and, with
    ``gguf_blocks``, for weights kept in GGUF blocks (cpu/backend.py)."""
    return cpu_backend.auto_dtype(gguf_blocks=gguf_blocks) if device.type == "cpu" else "bfloat16"
