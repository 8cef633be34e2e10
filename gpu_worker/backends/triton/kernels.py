"""The Triton backend's kernels, as the backend calls them: the K/V write and paged attention.

On a machine without a CUDA device they run under Triton's interpreter (see ``interpreter.py``).
"""

from __future__ import annotations

from gpu_worker.backends.triton.attention import AttentionRows, attention_rows, paged_attention
from gpu_worker.backends.triton.kv_write import write_kv

__all__ = ["AttentionRows", "attention_rows", "paged_attention", "write_kv"]
