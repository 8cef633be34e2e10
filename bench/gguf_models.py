"""Make the bench's bigger GGUFs (bench/lib/gguf_models.py) in the user's cache and print their paths.

python -m bench.gguf_models                      # the 1B in q4_k_m, q4_0, q4_1, q8_0 (skipped when made)
python -m bench.gguf_models --types q5_0,q5_1,iq4_nl,iq4_xs,q3_k_m,q2_k,bf16,f16,mixed  # the others
python -m bench.gguf_models --shapes gemma3_270m --types q4_k_m  # Gemma 3 270M's shape (Q5_0 mostly)
python -m bench.gguf_models --shapes qwen3moe30b --types q4_k_m   # the mixture of experts (~3.2 GB)
python -m bench.gguf_models --shapes deepseekv2lite --types q4_k_m  # DeepSeek-V2-Lite's, 27 layers (~10 GB)
python -m bench.gguf_models --shapes gemma4_e4b --types q4_k_m  # Gemma 4 E4B's, 12 layers (~1.7 GB)
python -m bench.gguf_models --shapes gptoss20b --types mxfp4  # gpt-oss-20b's, 8 layers (~6.1 GB)
python -m bench.targets --model llama1b-q4_k_m --peer-llama-cpp auto   # a made model by name
"""

from __future__ import annotations

import argparse
import sys

from bench.lib.gguf_models import (
    FILE_TYPES,
    GEMMA4_SHAPE,
    GPT_OSS_SHAPE,
    LLAMA_1B,
    MLA_SHAPE,
    SHAPES,
    ensure_model,
    model_path,
    write_model,
)

DEFAULT_TYPES = "q4_k_m,q4_0,q4_1,q8_0"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes",
        default=LLAMA_1B.name,
        help=f"comma list of {', '.join((*SHAPES, MLA_SHAPE, GEMMA4_SHAPE, GPT_OSS_SHAPE))}",
    )
    ap.add_argument("--types", default=DEFAULT_TYPES, help=f"comma list of {', '.join(FILE_TYPES)}")
    ap.add_argument("--force", action="store_true", help="rewrite files that exist")
    args = ap.parse_args(argv)
    own_writers = [
        name for name in (MLA_SHAPE, GEMMA4_SHAPE, GPT_OSS_SHAPE) if name in args.shapes.split(",")
    ]
    for name in own_writers:  # latent attention, Gemma 4, gpt-oss: their own writers
        for file_type in args.types.split(","):
            path = ensure_model(f"{name}-{file_type}")
            print(f"{name}-{file_type}: {path} ({path.stat().st_size / 1e6:.0f} MB)")
    for shape in (SHAPES[name] for name in args.shapes.split(",") if name not in own_writers):
        for file_type in args.types.split(","):
            path = model_path(shape, file_type)
            if args.force or not path.is_file():
                write_model(path, shape, file_type)
            print(f"{shape.name}-{file_type}: {path} ({path.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
