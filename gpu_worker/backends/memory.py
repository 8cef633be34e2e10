"""How much memory a backend gives the KV pool: a share of what the device has free."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

CPU_MAX_KV_TOKENS = 131072  # CPU pools beyond this only slow the machine down


def kv_pool_tokens(
    kv_cache_tokens: int, kv_mem_fraction: float, bytes_per_token: int, device: torch.device
) -> int:
    """How many tokens of KV to allocate: the configured count, else a fraction of free memory."""
    if kv_cache_tokens > 0:
        return kv_cache_tokens
    if device.type == "cuda":  # (backends/ alone asks what a device is)
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes * kv_mem_fraction) // bytes_per_token
    tokens = int(available_ram_bytes() * kv_mem_fraction) // bytes_per_token
    return min(tokens, CPU_MAX_KV_TOKENS)


def kv_pool_ceiling(kv_cache_tokens: int, device: torch.device) -> int | None:
    """The most tokens ``kv_pool_tokens`` can give, known before the model's shapes are: the
    configured count, else the CPU's cap; None on a GPU (its share of free memory is read later)."""
    if kv_cache_tokens > 0:
        return kv_cache_tokens
    return None if device.type == "cuda" else CPU_MAX_KV_TOKENS


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo; free physical pages where that file does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as exc:
        logger.debug("no /proc/meminfo (%s); using sysconf", exc)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
