"""Build llama.cpp's ``llama-server`` for one CPU kind into the cache, or print the cached one.

    python -m bench.llama_cpp build --kind avx2     # ~6-12 min on 2 cores; skipped once built (--force)
    python -m bench.llama_cpp path --kind avx2      # the cached binary, or exit 1

How it is built and where it goes: bench/lib/llama_cpp.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.lib.llama_cpp import (
    BUILD_KINDS,
    LlamaCppError,
    binary_path,
    build,
    build_command,
    cached_binary,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="llama.cpp's llama-server per CPU kind, for bench/targets.py")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "build", help="download the llama-cpp-python sdist and build llama-server into the cache"
    )
    b.add_argument("--kind", choices=BUILD_KINDS, required=True)
    b.add_argument("--force", action="store_true", help="rebuild even if the cache has this kind's binary")
    b.add_argument("--jobs", type=int, default=0, help="parallel compile jobs; 0: every core")
    b.add_argument(
        "--sdist-version", default=None, help="llama-cpp-python version to build (default: newest)"
    )
    b.add_argument(
        "--source", type=Path, default=None, help="a llama.cpp source tree to build instead of the sdist's"
    )
    q = sub.add_parser("path", help="print the cached llama-server of a kind; exit 1 if there is none")
    q.add_argument("--kind", choices=BUILD_KINDS, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "path":
        found = cached_binary(args.kind)
        if found is None:
            why = f"no llama-server for {args.kind} at {binary_path(args.kind)}"
            print(f"{why}; build it with `{build_command(args.kind)}`", file=sys.stderr)
            return 1
        print(found)
        return 0
    try:
        build(args.kind, args.force, args.jobs or None, args.source, args.sdist_version)
    except LlamaCppError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
