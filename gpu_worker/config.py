"""The GPU worker's configuration, built once by the launcher."""

from __future__ import annotations

from dataclasses import dataclass


WEIGHT_DTYPES = ("auto", "gguf", "bfloat16", "float32")


@dataclass(frozen=True)
class WorkerConfig:
    """What the worker loads and how much KV it allocates.

    ``model_path`` is an HF-layout directory (config.json + safetensors);
    ``gpu_worker.model_files.resolve_model`` turns any accepted --model into one.
    ``dtype="auto"`` is bfloat16 on CUDA and on CPUs with native bf16 dot
    products (AVX512-BF16 or AMX), float32 elsewhere; the KV pool uses the same.
    ``compile`` wraps the model's dense per-layer code in torch.compile.
    """

    model_path: str = ""
    device: str = "auto"  # auto: cuda if present, else cpu
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 | float64
    page_size: int = 16
    kv_cache_tokens: int = 0  # 0: size the pool from kv_mem_fraction
    kv_mem_fraction: float = 0.2  # of free device memory (CPU: available RAM)
    max_running_requests: int = 128  # request slots in the page table
    num_threads: int = 0  # torch threads on CPU; 0: all cores
    tune_threads: bool = False  # with num_threads 0: all cores or half, picked per batch shape (threads.py)
    compile: bool = False
    cpu_kernels: bool = True  # our C kernels on CPU (cpu_kernels.py): attention, small ops, gemv, argmax
    # How a GGUF model's weights are held: auto keeps the blocks of every type with a CPU kernel
    # quantized (gguf: the same, refusing to start where it cannot), --dtype for everything else;
    # bfloat16 / float32 dequantize (the weights rounded through that dtype), as for HF models.
    weight_dtype: str = "auto"
    gguf_path: str = ""  # the .gguf model_path was converted from (set by the launcher); "" if none
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.page_size >= 1, "page_size must be >= 1"
        assert 0.0 < self.kv_mem_fraction < 1.0, "kv_mem_fraction must be in (0, 1)"
        assert self.weight_dtype in WEIGHT_DTYPES, f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}"
