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
from typing import Any

import torch

from gpu_worker.attention import ForwardContext, build_metadata
from gpu_worker.config import WorkerConfig
from gpu_worker.cpu import backend as cpu_backend
from gpu_worker.gguf_weights import GgufError
from gpu_worker.kv_cache import KVPool, kv_pool_tokens
from gpu_worker.loader import load_model
from gpu_worker.models import CausalLM
from gpu_worker.penalties import SlotPenalties, check_prefix_ids
from gpu_worker.sampler import SlotSamplerParams, greedy_pick, sample
from gpu_worker.threads import ThreadTuner, shape_class
from protocol.messages import PENDING, ForwardBatch, ForwardResult

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
        self.penalties = SlotPenalties(
            config.max_running_requests, self.vocab_size, self._device, self._dtype
        )
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
        dtype = auto_dtype(self._device) if self.config.dtype == "auto" else self.config.dtype
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        self._dtype = _DTYPES[dtype]

    def _init_model(self) -> None:
        started = time.perf_counter()
        self.model, self.hf_config = self._load()
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
        if not self.config.gguf_path:
            return "the model is not a GGUF file"
        if self._device.type != "cpu":
            return f"quantized kernels exist for CPU only, not {self._device.type}"
        if self._dtype not in (torch.float32, torch.bfloat16):
            return f"quantized kernels take float32 or bfloat16 activations, not {self._dtype}"
        if self.config.compile:
            return "--compile runs torch's matmuls"
        if not cpu_backend.quantized_types(self.config.cpu_kernels):
            return "the CPU's C kernels are off or could not be built (see the log)"
        return None

    def _prepare_kernels(self) -> None:
        """--compile: torch.compile every layer's forward; on CPU, the CPU backend readies the model
        (kernels, matmul paths and weight layouts per CPU kind: gpu_worker/cpu/backend.py)."""
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
        if self._device.type == "cpu":
            setup = cpu_backend.prepare_model(
                model, self._dtype, self.config.cpu_kernels, self.config.compile
            )
            self._kernels = setup.kernels

    def _init_kv_pool(self) -> None:
        model = self.model
        elem_bytes = torch.empty((), dtype=self._dtype).element_size()
        bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * elem_bytes
        tokens = kv_pool_tokens(
            self.config.kv_cache_tokens, self.config.kv_mem_fraction, bytes_per_token, self._device
        )
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
        logits = self.compute_logits(batch)
        rows = [i for i, flag in enumerate(batch.sample) if flag]
        token_ids: list[int] = []
        logprobs: list[float] = []
        if rows:
            slots = [batch.slots[i] for i in rows]
            positions = [batch.prefix_lens[i] + batch.extend_lens[i] for i in rows]
            with torch.inference_mode():
                logits = self.penalties.apply(logits, slots, positions)  # before greedy's argmax too
                if self.sampler_params.plain_greedy(slots):
                    tokens, token_logprobs = greedy_pick(logits, self._kernels), None
                else:
                    params = self.sampler_params.batch(slots, positions, self._device)
                    tokens, token_logprobs = sample(logits, params)
                self.last_tokens[torch.tensor(slots, device=self._device)] = tokens
            token_ids = tokens.tolist()
            logprobs = token_logprobs.tolist() if token_logprobs is not None else []
        forward_s = time.perf_counter() - started
        if self._tuner is not None:
            self._tuner.record(shape, threads, forward_s)
        return ForwardResult(step=batch.step, token_ids=token_ids, logprobs=logprobs, forward_s=forward_s)

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
        """Apply the batch's page deltas and sampler settings, run the forward, and return the
        logits [rows with sample=True, vocab] at each such row's last token."""
        check_batch(batch, self.kv.num_pages, self.kv.page_table.shape, self._context_len, self.vocab_size)
        self.kv.apply_page_deltas(batch.slots, batch.page_starts, batch.page_counts, batch.pages)
        self.sampler_params.update(batch.slots, batch.sampler)
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
        hidden = self.model(input_ids, ctx)
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


def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every parameter through ``dtype`` in place (--weight-dtype bfloat16 under a wider --dtype)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.copy_(param.to(dtype))


def auto_dtype(device: torch.device) -> str:
    """bfloat16 on CUDA; on CPU what the CPU backend picks for the CPU kind (cpu/backend.py)."""
    return cpu_backend.auto_dtype() if device.type == "cpu" else "bfloat16"


def check_batch(
    batch: ForwardBatch, num_pages: int, page_table_shape: torch.Size, context_len: int, vocab_size: int
) -> None:
    """Reject a malformed batch before it reaches an index op (a CUDA index fault kills the process)."""
    rows = len(batch.slots)
    fields = (
        batch.prefix_lens,
        batch.extend_lens,
        batch.page_starts,
        batch.page_counts,
        batch.sample,
        batch.sampler,
    )
    if rows == 0 or any(len(f) != rows for f in fields):
        raise ValueError(f"batch {batch.step}: row fields must all have {rows} > 0 entries")
    if len(batch.input_ids) != sum(batch.extend_lens) or len(batch.pages) != sum(batch.page_counts):
        raise ValueError(f"batch {batch.step}: input_ids / pages do not match extend_lens / page_counts")
    max_slots, pages_per_request = page_table_shape
    if len(set(batch.slots)) != rows or not all(0 <= s < max_slots for s in batch.slots):
        raise ValueError(f"batch {batch.step}: slots must be distinct and in [0, {max_slots})")
    if any(n < 1 for n in batch.extend_lens) or any(p < 0 for p in batch.prefix_lens):
        raise ValueError(f"batch {batch.step}: extend_lens must be >= 1 and prefix_lens >= 0")
    if any(p + n > context_len for p, n in zip(batch.prefix_lens, batch.extend_lens, strict=True)):
        raise ValueError(f"batch {batch.step}: a row runs past the context length {context_len}")
    ends = (s + c for s, c in zip(batch.page_starts, batch.page_counts, strict=True))
    if any(s < 0 for s in batch.page_starts) or any(e > pages_per_request for e in ends):
        raise ValueError(f"batch {batch.step}: page deltas outside [0, {pages_per_request})")
    if batch.pages and not (0 <= min(batch.pages) and max(batch.pages) < num_pages):
        raise ValueError(f"batch {batch.step}: pages must be in [0, {num_pages})")
    if min(batch.input_ids) < PENDING or max(batch.input_ids) >= vocab_size:
        raise ValueError(f"batch {batch.step}: token ids must be in [0, {vocab_size}) or PENDING")
    check_prefix_ids(batch, vocab_size)
    if min(batch.input_ids) == PENDING:
        row_ends = set(accumulate(batch.extend_lens))
        if any(tok == PENDING and i + 1 not in row_ends for i, tok in enumerate(batch.input_ids)):
            raise ValueError(f"batch {batch.step}: PENDING may only be a row's last token")
