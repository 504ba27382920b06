"""Row copies between KV buffers ``[rows, H, D]``:

* :func:`copy_rows` ``dst[dst_idx[i]] = src[src_idx[i]]``: SpecCache's gather of the
  selected tokens and scatter of their recomputed K/V into the fused rows, and any
  slot-to-slot KV move;
* :func:`scatter_head_rows` ``out[pos[h, j], h] = rows[j, h]``: VeriCache's reload
  scatter, layer by layer: the rows compression dropped (per KV head, each head its own
  positions), staged from the host, put back beside the kept ones into the verify's
  staging buffer;
* :func:`gather_head_rows` ``out[j, h] = src[idx[h, j], h]``: SpeCache's fetch of each KV
  head's top-k full-precision rows, read by the GPU straight from pinned host memory
  (mapped under unified addressing) at indices that stay on the device: no host round
  trip.

On CUDA the caller runs them on its copy stream (``torch.cuda.stream``): the kernels
take no stream of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import Backend, backend_for, block, launch, on_device


def copy_rows_reference(dst: Tensor, dst_idx: Tensor, src: Tensor, src_idx: Tensor) -> Tensor:
    dst.index_copy_(0, dst_idx.to(dst.device, torch.int64),
                    src.index_select(0, src_idx.to(src.device, torch.int64)).to(dst.device, dst.dtype))
    return dst


@triton.jit
def _copy_kernel(dst, dst_idx, src, src_idx, sd0, ss0, width, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.load(dst_idx + i).to(tl.int64)
    s = tl.load(src_idx + i).to(tl.int64)
    m = c < width
    x = tl.load(src + s * ss0 + c, mask=m)
    tl.store(dst + d * sd0 + c, x.to(dst.dtype.element_ty), mask=m)


def copy_rows(dst: Tensor, dst_idx: Tensor, src: Tensor, src_idx: Tensor) -> Tensor:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for every ``i`` (rows contiguous inside).
    Rows are copied in no particular order: a row must not be both read and written."""
    if dst_idx.numel() != src_idx.numel():
        raise ValueError(f"copy_rows: {dst_idx.numel()} destinations for {src_idx.numel()} sources")
    if backend_for(dst) is Backend.TORCH or src.device != dst.device:
        return copy_rows_reference(dst, dst_idx, src, src_idx)
    n = dst_idx.numel()
    width = dst[0].numel() if dst.shape[0] else 0
    if n == 0 or width == 0:
        return dst
    if not (dst[0].is_contiguous() and src[0].is_contiguous()) or src[0].numel() != width:
        raise ValueError("copy_rows: rows must be contiguous and of the same size")
    bw = min(block(width), 1024)
    launch("copy_rows", _copy_kernel, (n, triton.cdiv(width, bw)), dst, dst_idx.to(torch.int64).contiguous(), src,
           src_idx.to(torch.int64).contiguous(), dst.stride(0), src.stride(0), width, BLOCK=bw)
    return dst


def scatter_head_rows_reference(out: Tensor, pos: Tensor, rows: Tensor) -> Tensor:
    if pos.numel():
        out.scatter_(0, on_device(pos.t().unsqueeze(-1).expand(-1, -1, out.shape[2]), out.device),
                     rows.to(out.dtype))
    return out


@triton.jit
def _scatter_kernel(out, pos, rows, so0, so1, sp0, sr0, sr1, D: tl.constexpr, BLOCK_D: tl.constexpr):
    j = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    p = tl.load(pos + h * sp0 + j).to(tl.int64)
    x = tl.load(rows + j * sr0 + h * sr1 + d, mask=d < D)
    tl.store(out + p * so0 + h * so1 + d, x.to(out.dtype.element_ty), mask=d < D)


def scatter_head_rows(out: Tensor, pos: Tensor, rows: Tensor) -> Tensor:
    """``out[pos[h, j], h, :] = rows[j, h, :]``: ``out [N, H, D]``, ``pos [H, n]``,
    ``rows [n, H, D]``."""
    if backend_for(out) is Backend.TORCH or rows.device != out.device:
        return scatter_head_rows_reference(out, pos, rows)
    h, n = pos.shape
    if n == 0:
        return out
    if out.stride(2) != 1 or rows.stride(2) != 1:
        raise ValueError("scatter_head_rows: the head dimension must be contiguous")
    pos = on_device(pos, out.device).to(torch.int64).contiguous()
    d = out.shape[2]
    launch("scatter_head_rows", _scatter_kernel, (n, h), out, pos, rows, out.stride(0), out.stride(1),
           pos.stride(0), rows.stride(0), rows.stride(1), D=d, BLOCK_D=block(d))
    return out


def gather_head_rows_reference(src: Tensor, idx: Tensor) -> Tensor:
    rows = src.gather(0, on_device(idx.t().to(torch.int64), src.device).unsqueeze(-1).expand(-1, -1, src.shape[2]))
    return on_device(rows, idx.device)


@triton.jit
def _gather_kernel(out, src, idx, so0, so1, ss0, ss1, si0, D: tl.constexpr, BLOCK_D: tl.constexpr):
    j = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    r = tl.load(idx + h * si0 + j).to(tl.int64)
    x = tl.load(src + r * ss0 + h * ss1 + d, mask=d < D)
    tl.store(out + j * so0 + h * so1 + d, x, mask=d < D)


def host_readable(src: Tensor) -> bool:
    """Whether a CUDA kernel can read ``src`` where it lies: a CUDA tensor, or pinned host
    memory (mapped into the device's address space under unified addressing)."""
    return src.is_cuda or (src.device.type == "cpu" and src.is_pinned() and torch.cuda.is_available())


def gather_head_rows(src: Tensor, idx: Tensor) -> Tensor:
    """``out[j, h, :] = src[idx[h, j], h, :]``: ``src [N, H, D]`` (on the device or in
    pinned host memory), ``idx [H, k]`` on the device; ``out [k, H, D]`` on ``idx``'s
    device. With CUDA indices and a pinned source the kernel reads the host rows over the
    bus itself, in stream order, and nothing waits on the host; elsewhere the torch path
    (which on CUDA would copy the indices to the host)."""
    if (backend_for(idx) is Backend.TORCH or src.stride(2) != 1
            or (idx.is_cuda and not host_readable(src)) or (not idx.is_cuda and src.is_cuda)):
        return gather_head_rows_reference(src, idx)
    h, k = idx.shape
    out = torch.empty(k, h, src.shape[2], dtype=src.dtype, device=idx.device)
    if k == 0:
        return out
    idx = idx.to(torch.int64).contiguous()
    d = src.shape[2]
    launch("gather_head_rows", _gather_kernel, (k, h), out, src, idx, out.stride(0), out.stride(1), src.stride(0),
           src.stride(1), idx.stride(0), D=d, BLOCK_D=block(d))
    return out
