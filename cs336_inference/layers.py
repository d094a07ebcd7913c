"""The building blocks of a Llama-style transformer: Linear, Embedding, RMSNorm, RoPE, SwiGLU.

Weights use the Hugging Face layout (a Linear's weight is [out, in], y = x W^T), so checkpoints
load without transposes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

_RANDOM_INIT: ContextVar[bool] = ContextVar("random_init", default=True)


@contextmanager
def skip_random_init() -> Iterator[None]:
    """Inside this block Linear and Embedding allocate their weights but leave them unfilled.

    For loaders, which overwrite every weight at once: filling SmolLM2's 135M weights with random
    numbers takes longer on a CPU than reading the checkpoint.
    """
    token = _RANDOM_INIT.set(False)
    try:
        yield
    finally:
        _RANDOM_INIT.reset(token)


def transposed_empty(rows: int, cols: int) -> Tensor:
    """A [rows, cols] tensor stored column-major (its transpose is contiguous).

    For a one-token decode step, y = x W^T with W stored this way runs as x @ (W^T contiguous),
    which CPU BLAS streams about 1.4x faster than the row-major matrix-vector product (measured
    with SmolLM2's shapes on 2 cores: 24 vs 18 GB/s); prefill speed is the same. Checkpoints are
    unaffected: the tensor keeps the [out, in] shape, and loading copies into it.
    """
    return torch.empty(cols, rows).t()


class Linear(nn.Module):
    """y = x W^T (+ b). Reading W is what decode pays for: D_in * D_out numbers per step."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(transposed_empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        if _RANDOM_INIT.get():
            nn.init.normal_(self.weight, std=1.0 / math.sqrt(d_in))

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"d_in={self.weight.shape[1]}, d_out={self.weight.shape[0]}, bias={self.bias is not None}"


class Embedding(nn.Module):
    """Token id -> row of a [V, D] table."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        # column-major as well: with tied embeddings this table is also the [V, D] output matrix
        self.weight = nn.Parameter(transposed_empty(vocab_size, d_model))
        if _RANDOM_INIT.get():
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, ids: Int[Tensor, "B T"]) -> Float[Tensor, "B T D"]:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g, computed in float32 and cast back (as Llama does)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Float[Tensor, "... D"]) -> Float[Tensor, "... D"]:
        """Normalize over the last dimension; returns a tensor of x's shape and dtype.

        The mean of squares is taken in float32 whatever x's dtype (fp16 activations of a few hundred
        overflow x^2 in fp16); the result is cast back to x.dtype before the gain g (self.weight).
        """
        # BEGIN SOLUTION rmsnorm
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
        # END SOLUTION


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of angle p * theta^(-2i/H) for positions p < max_seq_len, as [max_seq_len, H].

    Frequency i is used by dimensions i and i + H/2 (the rotate-half layout of Llama in HF).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: Float[Tensor, "... H"]) -> Float[Tensor, "... H"]:
    """(x1, x2) -> (-x2, x1) where x1, x2 are the first and second halves of the last dimension."""
    # BEGIN SOLUTION rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
    # END SOLUTION


def apply_rope(
    x: Float[Tensor, "B heads T H"], cos: Float[Tensor, "B T H"], sin: Float[Tensor, "B T H"]
) -> Float[Tensor, "B heads T H"]:
    """Rotate each pair (x_i, x_{i+H/2}) by its position's angle: x cos + rotate_half(x) sin.

    cos and sin are rows of `rope_tables` picked for each token's position (one row per batch row,
    shared by all heads). Returns a new tensor of x's shape and dtype. A query at position i and a
    key at position j then score a function of i - j only.
    """
    # BEGIN SOLUTION rope
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin
    # END SOLUTION


def interleaved_to_half(x: Float[Tensor, "... H"]) -> Float[Tensor, "... H"]:
    """Reorder dims (0, 1, 2, 3, ...) -> (0, 2, 4, ..., 1, 3, 5, ...).

    Checkpoints that rotate interleaved pairs (x_{2i}, x_{2i+1}) (DeepSeek, GGUF) become rotate-half
    ones; applied to both queries and keys it leaves every dot product unchanged.
    """
    return rearrange(x, "... (h two) -> ... (two h)", two=2)


class SwiGLU(nn.Module):
    """MLP(x) = W_down (silu(W_gate x) * W_up x): three [D, F] matrices, 6BTDF FLOPs."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = Linear(d_model, d_ff)
        self.up_proj = Linear(d_model, d_ff)
        self.down_proj = Linear(d_ff, d_model)

    def forward(self, x: Float[Tensor, "B T D"]) -> Float[Tensor, "B T D"]:
        """down_proj(silu(gate_proj(x)) * up_proj(x)), silu(z) = z * sigmoid(z)."""
        # BEGIN SOLUTION swiglu
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        # END SOLUTION
