"""A GGUF model with its weights kept as the file stores them: load_pretrained(path, packed=True).

By default a GGUF file is dequantized into a float model (its rounding baked in). Packed, every
matrix stored in a format that QuantizedLinear knows (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) becomes a
QuantizedLinear over the file's own bytes, memory-mapped copy-on-write: nothing is read until used
and no float copy of it is ever made, so a Q4_K_M model costs about its file size. The embedding
becomes a QuantizedEmbedding (a lookup dequantizes only its rows). Matrices in other formats, norms
and biases are read as float, as the default loader reads them.

The model is built on the meta device (no memory), its linears replaced one by one, then the rest
(norms, biases, rotary tables) is allocated and filled. Rows that the default loader reorders (the
llama architecture's Q/K permutation, Phi-3's fused projections) are cut or gathered as whole rows
of blocks, which is exact: a block never spans two rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from torch import Tensor, nn

from cs336_inference.io import gguf_read
from cs336_inference.io.sources import CheckpointError
from cs336_inference.layers import Embedding, Linear, transposed_empty
from cs336_inference.model import TransformerLM
from cs336_inference.quantization.linear import QuantizedEmbedding, QuantizedLinear, block_layout

PACKABLE = {T.Q8_0: "q8_0", T.Q4_0: "q4_0", T.Q4_1: "q4_1", T.Q5_0: "q5_0", T.Q4_K: "q4_k", T.Q6_K: "q6_k"}
_FUSED = {"attn_q": ("attn_qkv", 0), "attn_k": ("attn_qkv", 1), "attn_v": ("attn_qkv", 2),
          "ffn_gate": ("ffn_up", 0), "ffn_up": ("ffn_up", 1)}  # fmt: skip


class PackedReader:
    """The file's tensors by our names: raw rows of blocks where packable, float otherwise."""

    def __init__(self, path: Path):
        self.gguf = gguf_read.read_gguf(path)
        self.cfg = gguf_read.config_of(self.gguf)
        self.cow = np.memmap(path, dtype=np.uint8, mode="c")  # writable for torch, shared until written
        self.path = path

    def _where(self, ours: str) -> tuple[str, slice | None]:
        """The file's tensor for our weight, and the rows of it that are ours (Phi-3's fused attn_qkv
        holds q, k, v; its ffn_up holds gate then up)."""
        fname = gguf_read.ours_to_gguf(ours)
        part = fname.split(".")[-2]
        if self.cfg.model_type != "phi3" or part not in _FUSED:
            return fname, None
        whole, index = _FUSED[part]
        whole = f"blk.{fname.split('.')[1]}.{whole}.weight"
        cfg = self.cfg
        qkv = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
        sizes = qkv if part.startswith("attn") else [cfg.d_ff, cfg.d_ff]
        if whole not in self.gguf.tensors or self.gguf.tensors[whole].shape[0] != sum(sizes):
            return fname, None  # stored apart
        start = sum(sizes[:index])
        return whole, slice(start, start + sizes[index])

    def raw(self, ours: str) -> tuple[str, Tensor] | None:
        """(format, the stored rows [O, bytes per row]) of a packable matrix, None otherwise."""
        fname, rows = self._where(ours)
        if fname not in self.gguf.tensors:
            raise CheckpointError(f"{self.path}: missing tensor {fname}")
        info = self.gguf.tensors[fname]
        fmt = PACKABLE.get(info.qtype)
        if fmt is None or len(info.shape) != 2 or info.shape[1] % block_layout(fmt)[0]:
            return None
        data = torch.from_numpy(self.cow[info.offset : info.offset + info.nbytes].reshape(info.shape[0], -1))
        if rows is not None:
            data = data[rows]
        heads = {"attn_q": self.cfg.n_heads, "attn_k": self.cfg.n_kv_heads}.get(fname.split(".")[-2])
        if self.cfg.model_type == "llama" and heads is not None:
            data = gguf_read.unpermute_qk(data, heads).contiguous()  # whole rows of blocks move
        return fmt, data

    def float(self, ours: str) -> Tensor:
        fname, rows = self._where(ours)
        if fname not in self.gguf.tensors:
            raise CheckpointError(f"{self.path}: missing tensor {fname}")
        t = gguf_read.read_tensor(self.gguf, fname, self.cfg)
        return t if rows is None else t[rows]


def _linear(reader: PackedReader, name: str, module: Linear, dtype: torch.dtype) -> nn.Module:
    """A QuantizedLinear over the file's bytes for one of our Linears, or a float Linear."""
    d_out, d_in = module.weight.shape
    bias = None if module.bias is None else reader.float(name + ".bias")
    packed = reader.raw(name + ".weight")
    if packed is not None:
        fmt, data = packed
        return QuantizedLinear(fmt, d_in, d_out, {"qweight": data}, bias=bias)
    out = Linear(d_in, d_out, bias=bias is not None)
    out.weight = nn.Parameter(
        _float_weight(reader.float(name + ".weight"), (d_out, d_in), dtype), requires_grad=False
    )
    if bias is not None:
        out.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return out


def _float_weight(w: Tensor, shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
    if tuple(w.shape) != shape:
        raise CheckpointError(f"a tensor has shape {tuple(w.shape)}, expected {shape} from the config")
    out = transposed_empty(*shape).to(dtype)  # column-major, as the readable Linear keeps it
    out.t().copy_(w.t())
    return out


@torch.no_grad()
def load_packed(path: str | Path, dtype: torch.dtype = torch.float32) -> TransformerLM:
    """The model of a GGUF file with its packable matrices kept packed (see the module docstring)."""
    reader = PackedReader(Path(path))
    cfg = reader.cfg
    model = TransformerLM.empty(cfg, dtype, device="meta")
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            name = f"{parent_name}.{attr}" if parent_name else attr
            if type(child) is Linear:
                setattr(parent, attr, _linear(reader, name, child, dtype))
    packed = reader.raw("embed.weight")
    if packed is not None:
        fmt, data = packed
        model.embed = QuantizedEmbedding(
            QuantizedLinear(fmt, cfg.d_model, cfg.vocab_size, {"qweight": data}), dtype
        )
    else:
        model.embed = Embedding(cfg.vocab_size, cfg.d_model).requires_grad_(False)
        model.embed.weight = nn.Parameter(
            _float_weight(reader.float("embed.weight"), (cfg.vocab_size, cfg.d_model), dtype)
        )
    for name, p in list(model.named_parameters()):  # what is left on meta: norms
        if p.is_meta:
            module_name, _, attr = name.rpartition(".")
            value = reader.float(name).to(dtype)
            if tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{reader.path}: {name} has shape {tuple(value.shape)}, expected {tuple(p.shape)}"
                )
            setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))
    model.init_rope()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{reader.path}: nothing in the file for {left[0]}")
    return model.eval()
