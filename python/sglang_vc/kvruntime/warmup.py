"""Compile sgl-kernel-ext's Triton kernels when the runtime starts, not at the first
compressed request.

Triton compiles each kernel at its first launch of a specialization, on the thread that
launches it: here SGLang's scheduler thread, inside a forward, for seconds per kernel.
The runtime starts at SGLang's warm-up forward, before the server reports ready, so the
compiles are taken there, for the pool's dtype and this rank's head shapes, and logged
with their time (``sgl_kernel_ext.warmup``). On the CPU (the torch path) nothing compiles.
"""

from __future__ import annotations

import logging
from typing import Optional

import sgl_kernel_ext as ext
import torch
from sgl_kernel_ext import warmup

from sglang_vc import stats

logger = logging.getLogger(__name__)


def warm_up_kernels(pool_keys: torch.Tensor, num_q_heads: int, group: int = 32) -> Optional[float]:
    """Compile the kernels for a pool whose key buffer is ``pool_keys`` (``[slots, KV heads,
    head dim]``) serving ``num_q_heads`` query heads per rank; the seconds it took, or None
    where the kernels are not Triton's (the CPU) and nothing compiles."""
    if ext.backend_for(pool_keys) is not ext.Backend.TRITON or not ext.dispatch.is_cuda_tensor(pool_keys):
        return None
    _, hkv, d = pool_keys.shape
    try:
        seconds = warmup.warm_up(pool_keys.dtype, d, num_q_heads, hkv, pool_keys.device, group=group)
    except Exception as exc:  # noqa: BLE001 (a kernel that does not compile fails its requests, not the start)
        logger.warning("sgl-kernel-ext's Triton warm-up failed (%s: %s): the server starts, and compressed "
                       "requests whose kernels do not compile fail with an error", type(exc).__name__, exc)
        stats.add("kvruntime", kernel_warmup_failures=1)
        return None
    stats.add("kvruntime", kernel_warmup_ms=seconds * 1e3)
    logger.info("compiled sgl-kernel-ext's Triton kernels for %s, %d query and %d KV heads of dim %d, in %.1f s",
                str(pool_keys.dtype).removeprefix("torch."), num_q_heads, hkv, d, seconds)
    return seconds
