"""A Triton kernel for weight-only int8 on the GPU: y = (x q^T) * scale with q read as int8 once.

Eager PyTorch has no fused int8-weight product for CUDA: `F.linear(x, q.to(bf16))` first writes a
bf16 copy of the weight (reading 1 byte, writing 2 and reading 2 again per weight: slower than
bf16 itself). Here each program owns BLOCK_N output channels, streams their int8 rows in tiles of
BLOCK_K, casts the tile in registers and multiplies it with the x rows on the tensor cores (the
rows are padded to 16, which costs nothing: the product is bound by reading q). The per-channel
scale is applied once, to the [M, N] result.

Measured on an H100 (kernel time, replayed from a CUDA graph): 8192 x 8192 at M = 1 in 26 us
against bf16's 47 us (2.6 TB/s of int8), the same at M = 5; Llama-1B's 128256 x 2048 output matrix
in 91 us against 189 us. A variant without tensor cores (multiply and sum in registers, rows not
padded) was slower at every shape but the smallest (44 us at 8192 x 8192, M = 1): not kept.

Staff code: tests/test_kernels.py compares it with the readable reference on a GPU; without Triton
(or a GPU) `int8_linear` is None and fast/gpu/products.py falls back.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. the CPU-only torch wheel): fast/gpu/products.py falls back
    triton = None

if triton is not None:

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in [
                (16, 256, 4, 4),
                (32, 256, 4, 4),
                (32, 128, 4, 4),
                (64, 128, 4, 3),
                (16, 512, 4, 3),
                (64, 256, 8, 3),
            ]
        ],  # fmt: skip
        key=["N", "K", "BLOCK_M"],
    )
    @triton.jit
    def _int8_weight_only_kernel(
        x_ptr, q_ptr, scale_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :],
                mask=(rm[:, None] < M) & (rk[None, :] < K),
                other=0.0,
            )
            q = tl.load(
                q_ptr + rn[:, None] * stride_qn + rk[None, :],
                mask=(rn[:, None] < N) & (rk[None, :] < K),
                other=0,
            )
            acc += tl.dot(x, tl.trans(q.to(x.dtype)))
        scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = acc * scale[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


def int8_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor | None:
    """x [M, K] (bf16 / fp16, M <= 32) times int8 q [N, K]^T, times scale [N]: [M, N] in x's dtype.
    None where the kernel does not apply (no Triton, other dtypes, more rows)."""
    if triton is None or x.dtype not in (torch.bfloat16, torch.float16) or q.dtype != torch.int8:
        return None
    M, K = x.shape
    N = q.shape[0]
    if not 1 <= M <= 32 or x.stride(-1) != 1 or not q.is_contiguous():
        return None
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    block_m = 16 if M <= 16 else 32
    _int8_weight_only_kernel[grid](
        x, q, scale.contiguous(), y, M, N, K, x.stride(0), q.stride(0), y.stride(0), BLOCK_M=block_m
    )
    return y
