"""The building blocks of a Llama-style transformer: Linear, Embedding, RMSNorm, RoPE, SwiGLU (and
the switches of other families: scaled and partial RoPE, GeGLU).

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


ROPE_SCALINGS = ("linear", "llama3", "yarn")  # rope_scaling["rope_type"] values rope_frequencies knows


def rope_frequencies(
    dim: int, theta: float, scaling: dict | None = None, freqs: list[float] | None = None
) -> tuple[Float[Tensor, " R2"], float]:
    """The inverse frequencies theta^(-2i/dim) of the dim rotated dimensions, and the factor that
    multiplies cos and sin (1 except for YaRN).

    Long-context checkpoints stretch the slow frequencies so that positions past the training length
    look like ones the model saw (keys as in transformers' rope_parameters):
      linear   every frequency divided by `factor` (positions squeezed factor times);
      llama3   wavelengths longer than original_max_position_embeddings / low_freq_factor divided by
               `factor`, shorter than .. / high_freq_factor kept, a smooth blend between (Llama 3.1+);
      yarn     the same idea with a linear ramp over the dims between beta_fast and beta_slow rotations
               in the original window, and cos and sin scaled by 0.1 ln(factor) + 1 (or attention_factor).
    freqs: a GGUF file's rope_freqs tensor, which llama.cpp divides frequency i by.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if freqs is not None:
        inv_freq = inv_freq / torch.tensor(freqs, dtype=torch.float32)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    old_len = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        low_wavelen = old_len / scaling["low_freq_factor"]
        high_wavelen = old_len / scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"]
        )
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, dim, theta, factor, old_len, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")


def _yarn(inv_freq: Tensor, dim: int, theta: float, factor: float, old_len: int, scaling: dict):
    """YaRN: frequencies that turn fewer than beta_slow times in the original window are divided by
    factor, more than beta_fast times kept, a linear ramp between; cos and sin scaled by mscale."""

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns this often in old_len steps
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: dict | None = None,
    freqs: list[float] | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin of angle p * theta^(-2i/H) for positions p < max_seq_len, as [max_seq_len, H].

    Frequency i is used by dimensions i and i + H/2 (the rotate-half layout of Llama in HF).
    head_dim is the number of rotated dims (R < H under partial rotary); scaling and freqs stretch
    the frequencies of long-context checkpoints (`rope_frequencies`).
    """
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling, freqs)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


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


def apply_partial_rope(
    x: Float[Tensor, "B heads T H"], cos: Float[Tensor, "B T R"], sin: Float[Tensor, "B T R"]
) -> Float[Tensor, "B heads T H"]:
    """`apply_rope` on the first R dims of each head, the other H - R passed through (partial rotary,
    Phi-4-mini's partial_rotary_factor); plain apply_rope when R = H."""
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :R], cos, sin), x[..., R:]], dim=-1)


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


class GeGLU(SwiGLU):
    """Gemma's gated MLP: W_down (gelu_tanh(W_gate x) * W_up x), GELU with the tanh approximation."""

    def forward(self, x: Float[Tensor, "B T D"]) -> Float[Tensor, "B T D"]:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
