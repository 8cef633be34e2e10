"""Images in: time to first token with one 896x896 image, the same request again (a prefix-cache hit
through the image), and 8 requests with different images at once against one at a time.

    python -m bench.images                                  # rivulet on the Gemma-3-4B-shaped GGUF + mmproj
    python -m bench.images --peer-llama-cpp auto            # and llama-server --mmproj on the same files
    python -m bench.images --model DIR                      # an HF directory with its own tower

The default model is bench/lib/gguf_vlm_models.py's: a Gemma-3-4B-shaped Q4_K_M GGUF and its
SigLIP tower as llama.cpp's mmproj (made once, random weights). Every request is a chat completion
over HTTP, streamed, ``max_tokens`` small and EOS ignored where the server takes ``ignore_eos``;
TTFT is the time from sending to the first content chunk. Each image is random pixels (a PNG data
URI) seeded by its index, so the first request's image is new to the server and the second
request's the same. rivulet's worker logs each vision tower call with its batch size
(``vision tower: N image(s)``): the run prints the sizes it saw during the concurrent phase.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import re
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.lib import launch, llama_cpp
from gpu_worker.backends.cpu import kind as cpu_kind

TOWER_CALL = re.compile(r"vision tower: (\d+) image")
QUESTION = "Describe this picture in one sentence."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--model", default=None, help="GGUF or HF dir (default: the Gemma-3-4B-shaped bench GGUF)")
    add("--mmproj", default=None, help="the mmproj GGUF (default: the bench model's, with the default model)")
    add("--size", type=int, default=896, help="image side in pixels")
    add("--concurrency", type=int, default=8, help="requests with different images sent at once")
    add("--max-tokens", type=int, default=8, help="tokens each request generates")
    add("--rounds", type=int, default=3, help="repeats of each measurement (medians reported)")
    add("--flags", default="", help="extra rivulet launcher flags")
    add("--peer-llama-cpp", default=None, help="auto or a llama-server PATH: run it on the same files")
    add("--peer-ttft-only", action="store_true", help="measure the peer's cold and cache-hit TTFT only")
    add("--workdir", default=None, help="where the servers' logs go (default: a temp dir)")
    return p


def image_uri(seed: int, size: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat_body(uri: str, max_tokens: int) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": QUESTION}]
    return {"model": "bench", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip


async def ttft(client: httpx.AsyncClient, base_url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first content chunk, to the end) of one streamed chat completion."""
    started = time.perf_counter()
    first = None
    async with client.stream("POST", base_url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - started
    end = time.perf_counter() - started
    return (first if first is not None else end), end


async def measure(base_url: str, args: argparse.Namespace, seed_base: int, ttft_only: bool) -> dict[str, Any]:
    """One round: cold TTFT, the cache hit's, then (unless ``ttft_only``) the concurrent and
    sequential phases."""
    async with httpx.AsyncClient(timeout=1800) as client:
        body = chat_body(image_uri(seed_base, args.size), args.max_tokens)
        cold, _ = await ttft(client, base_url, body)
        hit, _ = await ttft(client, base_url, body)
        if ttft_only:
            return {"ttft_s": cold, "hit_ttft_s": hit}
        bodies = [
            chat_body(image_uri(seed_base + 1 + i, args.size), args.max_tokens)
            for i in range(args.concurrency)
        ]
        started = time.perf_counter()
        await asyncio.gather(*(ttft(client, base_url, b) for b in bodies))
        together = time.perf_counter() - started
        bodies = [
            chat_body(image_uri(seed_base + 101 + i, args.size), args.max_tokens)
            for i in range(args.concurrency)
        ]
        started = time.perf_counter()
        for b in bodies:
            await ttft(client, base_url, b)
        alone = time.perf_counter() - started
    return {"ttft_s": cold, "hit_ttft_s": hit, "together_s": together, "one_at_a_time_s": alone}


def run_rounds(name: str, base_url: str, args: argparse.Namespace, ttft_only: bool = False) -> dict[str, Any]:
    rounds = [asyncio.run(measure(base_url, args, 1000 * (r + 1), ttft_only)) for r in range(args.rounds)]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out["hit_over_cold"] = out["hit_ttft_s"] / out["ttft_s"]
    if not ttft_only:
        out["concurrent_speedup"] = out["one_at_a_time_s"] / out["together_s"]
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    model, mmproj = args.model, args.mmproj
    if model is None:
        from bench.lib.gguf_vlm_models import ensure_vlm

        text, projector = ensure_vlm()
        model, mmproj = str(text), mmproj or str(projector)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-images-"))
    port = launch.free_port()
    flags = ["--http-port", str(port), "--served-model-name", "bench", *shlex.split(args.flags)]
    flags += ["--mmproj", mmproj] if mmproj else []
    print(f"cpu: {cpu_kind.native_kind().value}; model {model}; mmproj {mmproj}", flush=True)
    with launch.rivulet_server("rivulet", flags, workdir / "rivulet", model) as server:
        run_rounds("rivulet", f"http://127.0.0.1:{port}", args)
        calls = [int(n) for n in TOWER_CALL.findall(server.log_path.read_text(errors="replace"))]
        print(f"rivulet vision tower batch sizes: {calls}", flush=True)
    if args.peer_llama_cpp:
        run_peer(args, model, mmproj, workdir)


def run_peer(args: argparse.Namespace, model: str, mmproj: str | None, workdir: Path) -> None:
    peer = llama_cpp.make_peer(
        args.peer_llama_cpp, cpu_kind.requested_kind(), model, parallel=args.concurrency
    )
    if peer.warning:
        print(peer.warning, flush=True)
    port = launch.free_port()
    cmd = [*peer.command(port), *(["--mmproj", mmproj] if mmproj else [])]
    print(f"llama.cpp: {shlex.join(cmd)}", flush=True)
    with launch.openai_server("llama.cpp", cmd, f"http://127.0.0.1:{port}", workdir / "llama-cpp"):
        run_rounds("llama.cpp", f"http://127.0.0.1:{port}", args, args.peer_ttft_only)


if __name__ == "__main__":
    main()
