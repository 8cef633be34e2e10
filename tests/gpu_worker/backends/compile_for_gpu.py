"""Compile the Triton kernels for an NVIDIA GPU on a machine without one, and print their resource use.

The interpreter runs a kernel's Python, not the compiler: a loop-carried variable that changes type,
a ``tl.dot`` dim under 16 or a constexpr misuse only fails in compilation. Triton's wheel carries
ptxas, so ``python -m tests.gpu_worker.backends.compile_for_gpu [sm]`` builds real cubins here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any

# (dtype, head_dim, group, max_extend_len, segments, softcap, page_size): a decode and an extend shape
# per dtype, every head-dim tile size, both page sizes, split and unsplit.
ATTENTION_VARIANTS = [
    ("bf16", 128, 4, 1, 4, False, 16),
    ("bf16", 256, 2, 300, 1, True, 16),
    ("fp16", 80, 8, 1, 2, False, 1),
    ("fp16", 64, 1, 300, 1, False, 16),
    ("fp32", 128, 1, 300, 1, False, 1),
    ("fp32", 32, 8, 1, 3, True, 16),
]

# (dtype, kv_lora_rank, qk_rope_head_dim, segments): latent attention's absorbed decode at
# DeepSeek's 512 + 64 in each dtype (split and unsplit) and at a tiny test shape.
LATENT_VARIANTS = [("bf16", 512, 64, 1), ("bf16", 512, 64, 4), ("fp32", 512, 64, 1), ("fp16", 32, 8, 2)]


def _signature(fn: Any, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict) -> dict:
    signature = {name: "i32" for name in fn.arg_names}
    signature.update(pointers)
    signature.update({name: "fp32" for name in floats})
    signature.update({name: "constexpr" for name in constexprs})
    return signature


def _resources(kernel: Any) -> str:
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return "(no cuobjdump)"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        command = [cuobjdump, "--dump-resource-usage", cubin.name]
        dump = subprocess.run(command, capture_output=True, text=True)
    return " ".join(re.findall(r"REG:\d+|STACK:\d+", dump.stdout))


def main(capability: int) -> None:
    """Compile every variant for ``sm_<capability>``; a failure raises."""
    os.environ["TRITON_INTERPRET"] = "0"  # before the kernel modules decorate: compiled, not interpreted
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from gpu_worker.backends.triton import attention_kernels, kv_write, mla_decode, mla_kernels
    from gpu_worker.backends.triton.attention import _tiles

    target = GPUTarget("cuda", capability, 32)

    def build(fn: Any, pointers: dict[str, str], floats: tuple[str, ...], consts: dict, warps: int) -> str:
        source = ASTSource(fn, _signature(fn, pointers, floats, consts), consts)
        return _resources(compile(source, target=target, options={"num_warps": warps}))

    for dtype, head_dim, group, max_extend_len, segments, softcap, page_size in ATTENTION_VARIANTS:
        tiles = _tiles(head_dim, group, max_extend_len, fp32=dtype == "fp32")
        consts = dict(
            HEAD_DIM=head_dim,
            BLOCK_D=tiles.block_d,
            GROUP=group,
            BLOCK_Q=tiles.block_q,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            PAGE_SIZE=page_size,
            NUM_SEGMENTS=segments,
            USE_SOFTCAP=softcap,
            USE_SINKS=not softcap,  # each variant with or without gpt-oss's sinks
            DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
        )
        pointers = {name: f"*{dtype}" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        pointers |= {"page_table_ptr": "*i64", "req_pool_idx_ptr": "*i32", "q_starts_ptr": "*i32"}
        pointers |= {"prefix_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32"}
        pointers |= {"part_sum_ptr": "*fp32", "sinks_ptr": "*fp32"}
        floats = ("scale", "softcap")
        usage = build(attention_kernels._attention_kernel, pointers, floats, consts, tiles.num_warps)
        print(f"attention {dtype} D={head_dim} group={group} {tiles}: {usage}", flush=True)
    merge = dict(HEAD_DIM=96, BLOCK_D=128, NUM_SEGMENTS=3, BLOCK_S=4, USE_SINKS=True)
    pointers = {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"}
    pointers["sinks_ptr"] = "*fp32"
    print("merge:", build(attention_kernels._merge_segments_kernel, pointers, (), merge, 4))
    pointers = {name: "*fp16" for name in ("k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr")}
    pointers["out_locs_ptr"] = "*i64"
    write = dict(HEAD_DIM=80, BLOCK_H=8, BLOCK_D=128)
    print("write_kv:", build(kv_write._write_kv_kernel, pointers, (), write, 4))
    for dtype, rank, rope, segments in LATENT_VARIANTS:
        t = mla_decode._tiles(rank, rope, fp32=dtype == "fp32")
        consts = dict(KV_RANK=rank, ROPE_DIM=rope, BLOCK_R=t.block_r, BLOCK_P=t.block_p,
                      BLOCK_H=mla_decode.BLOCK_H, BLOCK_N=t.block_n, PAGE_SIZE=16, NUM_SEGMENTS=segments,
                      DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")  # fmt: skip
        pointers = {name: f"*{dtype}" for name in ("q_lat_ptr", "q_rope_ptr", "cache_ptr", "out_ptr")}
        pointers |= {"page_table_ptr": "*i64", "pool_idx_ptr": "*i64", "positions_ptr": "*i64"}
        pointers |= {name: "*fp32" for name in ("part_out_ptr", "part_max_ptr", "part_sum_ptr")}
        usage = build(mla_kernels._latent_decode_kernel, pointers, ("scale",), consts, t.num_warps)
        print(f"latent decode {dtype} {rank} + {rope}, {segments} segments, {t}: {usage}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
