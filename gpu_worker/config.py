"""The GPU worker's configuration, built once by the launcher."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.flags import flag, given, max_running_requests_field, mmproj_field, seed_field

WEIGHT_DTYPES = ("auto", "gguf", "bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
LATENT_FORMS = ("auto", "absorbed", "expanded")


def why_no_fp8_pool(latent: bool, backend: str, c_kernels: bool, activations: str) -> str | None:
    """Why ``--kv-cache-dtype fp8_e4m3`` cannot be served (None: it can): only the CPU's C latent
    attention (csrc/mla.c) reads a float8 pool; torch's, Triton's and per-head K/V paths do not."""
    if not latent:
        return "a float8 pool is latent attention's (DeepSeek-V2/V3, GLM-4.7-Flash), not per-head K/V's"
    if backend != "cpu":
        return f"only the cpu backend's C kernels read a float8 latent pool, not the {backend} backend"
    if not c_kernels:
        return "only the CPU's C kernels read a float8 latent pool: off (--disable-cpu-kernels) or not built"
    if activations not in ("auto", "float32", "bfloat16"):
        return f"the C latent attention takes float32 or bfloat16 activations, not {activations}"
    return None


@dataclass(frozen=True)
class WorkerConfig:
    """What the worker loads and how much KV it allocates.

    ``model_path`` is an HF-layout directory (config.json + safetensors);
    ``gpu_worker.weights.model_files.resolve_model`` turns any accepted --model into one.
    ``dtype="auto"`` is bfloat16 on CUDA and on CPUs with native bf16 dot
    products (AVX512-BF16 or AMX), float32 elsewhere; the KV pool's is ``kv_cache_dtype``.
    ``compile`` wraps the model's dense per-layer code in torch.compile. Each field's
    ``flag`` is its launcher option (protocol/flags.py).
    """

    model_path: str = given("", "the launcher: --model resolved to an HF directory")
    device: str = flag("auto", "auto | cpu | cuda | cuda:N (auto: cuda if present, else cpu)")
    dtype: str = flag("auto", "auto | float32 | bfloat16 | float16 | float64")
    device_backend: str = flag(
        "auto",
        "auto | cpu | torch | triton: the worker's device backend, its matmuls, attention and kernels "
        "(auto: triton on CUDA, cpu on CPU; torch: the generic reference path on any device; triton "
        "on CPU runs interpreted, for tests)",
    )
    kv_cache_dtype: str = flag(
        "auto",
        "the KV pool's dtype: auto (under float32 activations a 16-bit pool where the backend's "
        "attention reads it in place: float16 for the CPU's C kernels, bfloat16 for Triton on a GPU; "
        "else the activations' dtype), float32, bfloat16, float16, fp8_e4m3 (a latent-attention model's "
        "pool on the cpu backend's C kernels: one byte a value, e4m3 without a scale, saturated at +-448)",
        choices=KV_CACHE_DTYPES,
    )
    page_size: int = flag(16, "tokens per KV page")
    kv_cache_tokens: int = flag(
        0, "KV pool size in tokens; 0: use --kv-mem-fraction (the pool also bounds the context served)"
    )
    kv_mem_fraction: float = flag(0.2, "KV pool share of free device memory (CPU: available RAM)")
    max_running_requests: int = max_running_requests_field()
    num_threads: int = flag(
        0, "worker torch threads; 0: all cores, half of them while steps wait for a core (docs/cpu.md)"
    )
    tune_threads: bool = flag(
        False,
        "with --num-threads 0: use all cores or half per batch shape, whichever measures faster, "
        "in place of the contention guard (slower on an idle CPU)",
        negatable=True,
    )
    compile: bool = flag(
        False,
        "torch.compile the worker's dense layer code (slower start; no oneDNN weight packing)",
        negatable=True,
    )
    cpu_kernels: bool = flag(
        True,
        "use torch instead of the worker's C kernels (decode attention, RMSNorm, rotary, silu * up, "
        "one-row matmul; built with the system C compiler on first start; without one the worker "
        "uses torch anyway)",
        name="--disable-cpu-kernels",
    )
    weight_dtype: str = flag(
        "auto",
        "a GGUF model's weights: auto keeps the blocks of every type with a CPU kernel (Q4_0, Q4_1, "
        "Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS, MXFP4; F16 and BF16 as 16-bit) quantized and uses "
        "--dtype for the rest; gguf the same, refusing to "
        "start where it cannot; bfloat16/float32 dequantize at load (rounded through that dtype)",
        choices=WEIGHT_DTYPES,
    )
    latent_attention: str = flag(
        "auto",
        "latent attention's form (DeepSeek-V2/V3, GLM-4.7-Flash): auto (a prompt's rows expand the "
        "latents to per-head K/V, decode rows attend over the latents with kv_b absorbed into q and "
        "the output), absorbed or expanded for every row (for benchmarks)",
        choices=LATENT_FORMS,
    )
    state_checkpoints: int = flag(
        -1,
        "a hybrid model's (Qwen3.5, Qwen3-Next) recurrent-state checkpoints for the prefix cache, each "
        "as large as a request's state (the start log says how large); -1: as many as a quarter of the "
        "KV pool's bytes holds, from 2 to --max-running-requests; 0: none, the prefix cache off for "
        "such a model",
    )
    mmproj: str | None = mmproj_field()
    gguf_path: str = given("", "the launcher: the .gguf --model names (the embedded one by default)")
    replica: int = given(0, "the launcher: its data-parallel replica (--dp-size)")
    cpu_ids: tuple[int, ...] = given((), "the launcher: its replica's share of the cores (--dp-size > 1)")
    tp_size: int = flag(
        1,
        "tensor-parallel ranks: the model's heads and MLP split over N worker processes joined in a "
        "gloo process group (on any device), one scheduler driving them all; with --nnodes, spread over "
        "the nodes",
    )
    tp_all_reduce: str = flag(
        "auto",
        "how tensor-parallel ranks sum their partial products: shm (a shared memory region; ranks on "
        "one machine with the C kernels built), gloo (torch.distributed), auto: shm where it can",
        choices=("auto", "shm", "gloo"),
    )
    tp_rank: int = given(0, "the launcher: its tensor-parallel rank (--tp-size), over all nodes")
    dist_init_addr: str = flag(
        "",
        "HOST:PORT of the tensor-parallel ranks' torch.distributed TCP store, served by rank 0 on "
        "node 0; every node is given the same (needed with --nnodes > 1; default: a free local port)",
        unset_default=None,  # unset: the launcher picks a free loopback port
    )
    node_host: str = given(
        "", "the launcher of a worker node (--node-rank > 0): the address its ranks take batches on"
    )
    seed: int = seed_field()

    def __post_init__(self) -> None:
        assert self.page_size >= 1, "page_size must be >= 1"
        assert 0.0 < self.kv_mem_fraction < 1.0, "kv_mem_fraction must be in (0, 1)"
        assert self.weight_dtype in WEIGHT_DTYPES, f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}"
        assert self.kv_cache_dtype in KV_CACHE_DTYPES, (
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}"
        )
