"""Refusals decided before any child starts: from the flags, the model's config, this machine's
torch and its sockets.

Each raises StartRefused with one line; the launcher prints it and exits 2, as it does for a model
it cannot find. What is checked here would otherwise fail in a child, after the weights loaded (a
minute for a big model), as a traceback: a --tp-size that does not split the heads, a CUDA device
this torch cannot use, a port or endpoint another process holds.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpu_worker.backends import NAMES as DEVICE_BACKENDS
from gpu_worker.config import why_no_fp8_pool
from gpu_worker.weights.model_files import source_gguf
from launcher_flags import check_endpoint, check_nodes, config_from_args, scheduler_config, worker_config
from protocol import WorkerReady
from tokenizer_proc.config import TokenizerConfig

logger = logging.getLogger("rivulet.launcher")

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")  # gpu_worker/model_runner.py's, and auto
# The mmproj projectors the worker reads (gpu_worker/weights/mmproj.py's SUPPORTED, kept off torch here).
MMPROJ_PROJECTORS = ("gemma3", "gemma4v", "qwen3vl_merger")
CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")
PROBE_TIMEOUT_S = 2.0  # a live engine accepts a unix-socket connection at once
# What this machine's torch can do with CUDA, asked in a child so the launcher itself never loads torch.
TORCH_PROBE = (
    "import torch; print(torch.__version__, int(torch.backends.cuda.is_built()), torch.cuda.device_count())"
)
TORCH_PROBE_TIMEOUT_S = 120.0


class StartRefused(Exception):
    """A start the flags, the model or this machine rule out; the message is the launcher's one line."""


def check_flags(args: argparse.Namespace) -> None:
    """The flags alone: the node layout, the endpoint's form, every config's own ranges, the names
    the worker would only read once it started."""
    try:
        check_nodes(args)
        check_endpoint(args.endpoint)
    except SystemExit as exc:  # launcher_flags' checks exit with their message
        raise StartRefused(str(exc.code)) from None
    # The scheduler's and worker's configs assert their fields' ranges; the scheduler's is otherwise
    # built only once the worker reported its KV pool, after the model loaded.
    ready = WorkerReady(pid=0, num_pages=1, page_size=args.page_size, context_len=1, device="", dtype="")
    try:
        worker_config(args, "")
        scheduler_config(args, ready)
        config_from_args(TokenizerConfig, args, model_path="", served_model_name="")
    except AssertionError as exc:
        raise StartRefused(f"a flag out of range: {exc}") from None
    if args.dtype not in DTYPES:
        raise StartRefused(f"--dtype {args.dtype}: expected one of {', '.join(DTYPES)}")
    if args.device_backend not in ("auto", *DEVICE_BACKENDS):
        names = ", ".join(("auto", *DEVICE_BACKENDS))
        raise StartRefused(f"--device-backend {args.device_backend}: expected one of {names}")
    why_not = _why_no_gguf_blocks(args) if args.weight_dtype == "gguf" else None
    if why_not is not None:
        raise StartRefused(f"--weight-dtype gguf: {why_not}")


def _why_no_gguf_blocks(args: argparse.Namespace) -> str | None:
    """What the flags say against weights kept in GGUF blocks (the worker's own test, as far as the
    flags decide it: gpu_worker/model_runner.py's _why_not_quantized)."""
    if source_gguf(args.model) is None:
        return "the model is not a GGUF file"
    if args.compile:
        return "--compile runs torch's matmuls"
    if not args.cpu_kernels:
        return "the block kernels are the CPU's C kernels, which --disable-cpu-kernels turns off"
    if args.device_backend in ("torch", "triton") or args.device.startswith("cuda"):
        return "only the cpu backend computes on GGUF blocks"
    if args.dtype not in ("auto", "float32", "bfloat16"):
        return f"quantized kernels take float32 or bfloat16 activations, not {args.dtype}"
    return None


def check_model(args: argparse.Namespace, model_dir: Path) -> None:
    """What the model's config (config.json, written from a GGUF's metadata) rules out."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config.get("num_attention_heads") or config.get("n_head")  # GPT-2 names it n_head
    kv_heads = config.get("num_key_value_heads") or heads
    _check_hybrid(args, config)
    _check_mmproj(args)
    _check_gemma4(args, config)
    _check_kv_dtype(args, config)
    if args.tp_size > 1 and config.get("model_type") == "gpt_oss":
        raise StartRefused(
            f"--tp-size {args.tp_size}: gpt-oss's attention sinks (one per head) and its experts' biases do "
            "not split over tensor-parallel ranks yet; use --tp-size 1"
        )
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return  # a config that names no heads: the worker's own check decides
    if heads % args.tp_size or kv_heads % args.tp_size:
        common = math.gcd(heads, kv_heads)
        sizes = [str(n) for n in range(1, common + 1) if common % n == 0]
        fits = " or ".join([", ".join(sizes[:-1]), sizes[-1]] if len(sizes) > 1 else sizes)
        raise StartRefused(
            f"--tp-size {args.tp_size} does not divide the model's {heads} attention heads and "
            f"{kv_heads} KV heads (tensor parallel splits them evenly: --tp-size {fits})"
        )


def _check_mmproj(args: argparse.Namespace) -> None:
    """--mmproj: a GGUF whose projector the worker runs (gpu_worker/weights/mmproj.py)."""
    if args.mmproj is None:
        return
    if not Path(args.mmproj).is_file():
        raise StartRefused(f"--mmproj {args.mmproj}: no such file")
    from gguf import GGUFReader

    try:
        fields = GGUFReader(args.mmproj).fields
        # Gemma 4's converter (vision and audio) names the vision projector under clip.vision.
        field = fields.get("clip.projector_type") or fields.get("clip.vision.projector_type")
    except Exception as exc:  # gguf-py raises what numpy and its parser raise on a bad file
        raise StartRefused(f"--mmproj {args.mmproj}: not a GGUF file ({exc})") from None
    projector = field.contents() if field is not None else None
    if projector not in MMPROJ_PROJECTORS:
        raise StartRefused(
            f"--mmproj {args.mmproj}: projector type {projector!r} is not supported "
            f"({', '.join(MMPROJ_PROJECTORS)} are)"
        )


def _check_hybrid(args: argparse.Namespace, config: dict[str, object]) -> None:
    """A hybrid model (linear-attention layers beside attention: Qwen3.5, Qwen3-Next) keeps a
    recurrent state per request, which n-gram speculation and tensor parallel do not handle yet."""
    text = config.get("text_config")
    layer_types = (text if isinstance(text, dict) else config).get("layer_types") or []
    if "linear_attention" not in layer_types:  # type: ignore[operator]
        return
    name = config.get("model_type")
    if args.speculative_algorithm != "none":
        raise StartRefused(
            f"--speculative-algorithm {args.speculative_algorithm}: {name}'s linear-attention layers keep "
            "a recurrent state that a verify batch cannot roll back to its last kept draft; serve it "
            "without speculation"
        )
    if args.tp_size > 1:
        raise StartRefused(
            f"--tp-size {args.tp_size}: {name}'s linear-attention layers (Gated DeltaNet) do not split "
            "over tensor-parallel ranks yet; use --tp-size 1"
        )


def _check_kv_dtype(args: argparse.Namespace, config: dict[str, Any]) -> None:
    """--kv-cache-dtype fp8_e4m3: a latent-attention model on the cpu backend's C kernels (the worker
    asks the same of the backend it got: a CUDA device under --device auto is the worker's to refuse)."""
    if args.kv_cache_dtype != "fp8_e4m3":
        return
    backend = args.device_backend
    if backend == "auto":
        backend = "triton" if args.device.startswith("cuda") else "cpu"
    latent = "kv_lora_rank" in config  # DeepSeek-V2/V3, GLM-4.7-Flash (a GGUF's config.json too)
    why_not = why_no_fp8_pool(latent, backend, args.cpu_kernels, args.dtype)
    if why_not is not None:
        raise StartRefused(f"--kv-cache-dtype fp8_e4m3: {why_not}")


def _check_gemma4(args: argparse.Namespace, config: dict[str, Any]) -> None:
    """Gemma 4's global layers have their own KV head count (often 1 or 2): tensor parallel splits
    every layer's heads, so each count must divide by the ranks."""
    if args.tp_size == 1 or config.get("model_type") not in ("gemma4", "gemma4_text"):
        return
    text = config.get("text_config") or config
    per_layer = (text.get("per_layer_config") or {}).values()
    named = [text.get("num_attention_heads"), text.get("num_key_value_heads")]
    named += [layer.get("num_key_value_heads") for layer in per_layer]
    counts = {n for n in named if isinstance(n, int)}
    bad = sorted(n for n in counts if n % args.tp_size)
    if bad:
        raise StartRefused(
            f"--tp-size {args.tp_size} does not divide Gemma 4's head counts {bad} (its layers' query, "
            f"KV and global KV heads: {sorted(counts)}; tensor parallel splits every layer's heads)"
        )


def check_device(args: argparse.Namespace) -> None:
    """A CUDA --device this torch cannot use. Only a CUDA device pays for the probe (torch's import,
    a few seconds), and only a probe that answered refuses."""
    found = CUDA_DEVICE.fullmatch(args.device)
    if found is None:
        return  # auto, cpu, or another torch device: the worker's torch.device() judges it
    if args.device_backend == "cpu":
        raise StartRefused(f"--device-backend cpu runs on the CPU, not --device {args.device}")
    probe = _torch_cuda()
    if probe is None:
        return
    version, built, count = probe
    if not built:
        raise StartRefused(f"--device {args.device}: this torch ({version}) is built without CUDA")
    index = int(found.group(1) or 0)
    if index >= count:
        seen = "no CUDA device is visible" if count == 0 else f"this machine has {count} CUDA device(s)"
        raise StartRefused(f"--device {args.device}: {seen}")


def _torch_cuda() -> tuple[str, bool, int] | None:
    """This torch's version, whether it is built with CUDA (or ROCm, which torch calls cuda too) and
    the CUDA devices it sees; None when the probe failed (the worker then says why)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", TORCH_PROBE], capture_output=True, text=True, timeout=TORCH_PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return None
    try:
        version, built, count = done.stdout.split()
        return version, built == "1", int(count)
    except ValueError:
        logger.warning("could not ask torch about CUDA: %s", done.stderr.strip()[-500:])
        return None


def check_endpoints_free(args: argparse.Namespace) -> None:
    """The client endpoint and the HTTP port are free (a stale socket file of a dead engine is
    removed). The tokenizer binds both once its tokenizer loaded; a start that races this one to
    the same endpoint in those seconds is not caught."""
    endpoint = args.endpoint
    if endpoint.startswith("ipc://"):
        _check_ipc_free(endpoint, endpoint[len("ipc://") :])
    elif endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if port.isdigit() and int(port) > 0:  # tcp://HOST:* or :0 takes any free port
            _check_tcp_free(f"--endpoint {endpoint}", host.strip("[]"), int(port))
    if args.http_port:  # None serves no HTTP, 0 takes any free port
        _check_tcp_free(f"--http-port {args.http_port}", args.http_host, args.http_port)


def _check_ipc_free(endpoint: str, path: str) -> None:
    """Nothing listens at ``path``; a socket file nothing listens on is removed. libzmq's bind would
    replace it either way, live or not: this is what keeps a second engine from taking a live
    engine's endpoint (which then serves no one once the second stops)."""
    abstract = path.startswith("@")  # Linux's abstract namespace: no file to be stale
    if not abstract and not os.path.lexists(path):
        return
    if not abstract and not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise StartRefused(f"--endpoint {endpoint}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect("\0" + path[1:] if abstract else path)
        except (ConnectionRefusedError, FileNotFoundError):
            if not abstract:
                os.unlink(path)
                logger.info("--endpoint %s: removed the socket file of an engine that is gone", endpoint)
            return
        except TimeoutError:
            pass  # a listener too busy to accept is still a listener
        except OSError as exc:
            raise StartRefused(
                f"--endpoint {endpoint}: cannot tell whether {path} is in use: {exc}"
            ) from None
    raise StartRefused(f"--endpoint {endpoint}: another engine is listening there (stop it or pick another)")


def _check_tcp_free(what: str, host: str, port: int) -> None:
    """``host:port`` can be bound: the test bind takes SO_REUSEADDR, as the tokenizer's does, so a
    closed connection's TIME_WAIT does not count as in use."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise StartRefused(f"{what}: {host}:{port} is in use (another engine?)") from None
        raise StartRefused(f"{what}: cannot bind {host}:{port}: {exc.strerror or exc}") from None
