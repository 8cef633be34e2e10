"""Start-up of a model file: launcher to its Ready line, and the bytes written on the way, first start
and warm.

    python -m bench.startup [--model llama1b-q4_k_m | FILE.gguf | DIR] [--rounds 3]

Each round starts the engine twice on a cache root of its own (``$RIVULET_CACHE_DIR`` in a temp
dir, empty but for the C kernels, which are linked in already built: the cost measured is the
model's, not the compiler's): the first start finds nothing of the model cached, the second finds
what the first left. A start is timed from spawning ``launcher.py`` to its Ready line; the bytes
written are the cache root's growth over the start (the kernels' link not counted). The engine is
stopped after each start. A median over rounds is printed per start kind.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.launch import rivulet_server


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (links not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            if not path.is_symlink():
                total += path.stat().st_size
    return total


def one_start(model: str, cache: Path, workdir: Path) -> tuple[float, int]:
    """(seconds to Ready, bytes the start wrote under ``cache``)."""
    before = tree_bytes(cache)
    os.environ["RIVULET_CACHE_DIR"] = str(cache)  # the launcher inherits the environment
    t0 = time.perf_counter()
    with rivulet_server("startup", ["--kv-cache-tokens", "4096"], workdir, model=model):
        ready_s = time.perf_counter() - t0
    return ready_s, tree_bytes(cache) - before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama1b-q4_k_m", help="a bench model's name, a GGUF or a model dir")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    from bench.lib import gguf_models
    from gpu_worker.weights.model_files import cache_root

    model = gguf_models.resolve(args.model)  # made (once) in the user's cache, before any timing
    assert model is not None
    kernels = cache_root() / "kernels"
    assert kernels.is_dir(), f"no built C kernels under {kernels}: start the engine once first"
    results: dict[str, list[tuple[float, int]]] = {"first": [], "warm": []}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="rivulet-startup-") as tmp:
            cache = Path(tmp) / "cache"
            cache.mkdir()
            (cache / "kernels").symlink_to(kernels)
            for kind in ("first", "warm"):
                ready_s, written = one_start(model, cache, Path(tmp) / kind)
                results[kind].append((ready_s, written))
                print(
                    f"round {r} {kind}: {ready_s:.2f} s to Ready, {written / 1e6:.2f} MB written", flush=True
                )
    size = Path(model).stat().st_size if Path(model).is_file() else tree_bytes(Path(model))
    print(f"\n# {Path(model).name} ({size / 1e6:.0f} MB)")
    print("| start | seconds to Ready, median (min-max) | MB written, median |")
    print("|---|---|---|")
    for kind, runs in results.items():
        secs = [s for s, _ in runs]
        mb = statistics.median(w for _, w in runs) / 1e6
        print(f"| {kind} | {statistics.median(secs):.2f} ({min(secs):.2f}-{max(secs):.2f}) | {mb:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
