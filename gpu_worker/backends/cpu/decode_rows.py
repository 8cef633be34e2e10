"""The decode rows of a batch as the C attention kernel reads them (built by ``CpuKernels.decode_rows``)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class DecodeRows(NamedTuple):
    """Decode rows as the attention kernel reads them: pointers to int64 tensors, and sizes."""

    q_rows: int
    req_pool_idx: int
    kv_lens: int
    page_table: int
    pt_stride: int
    rows: int
    page_size: int
    tensors: tuple[torch.Tensor, ...]  # what the pointers point into, kept alive with them
