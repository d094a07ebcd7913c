"""Reading a checkpoint one tensor, or one slice of a tensor, at a time (for a tensor-parallel rank).

`checkpoint_tensors(path)` gives the model's config and a reader: reader(where) yields each weight
of the model by our state-dict name, cut to where(name) = (dim, start, stop) (None: whole). From a
safetensors folder only the slice is read from disk; a GGUF tensor is dequantized alone and then
cut. Every full tensor's shape is checked against the config first, as load_pretrained does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from safetensors import safe_open
from torch import Tensor

from ..config import ModelConfig
from ..model import TransformerLM
from . import gguf_read
from .checkpoint import (
    check_shape,
    folder_config,
    hf_names,
    hf_tensors_in,
    read_safetensors,
    safetensors_files,
)
from .sources import CheckpointError, resolve_checkpoint

Where = Callable[[str], "tuple[int, int, int] | None"]
Reader = Callable[[Where], Iterator[tuple[str, Tensor]]]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and full shape (a model on the meta device: nothing allocated)."""
    model = TransformerLM.empty(cfg, device="meta")
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _cut(tensor: Tensor, where) -> Tensor:
    if where is None:
        return tensor
    dim, start, stop = where
    return tensor.narrow(dim, start, stop - start)


def checkpoint_tensors(path: str | os.PathLike) -> tuple[ModelConfig, Reader]:
    source = resolve_checkpoint(path)
    if source.kind == "gguf":
        gguf = gguf_read.read_gguf(source.path)
        cfg = gguf_read.config_of(gguf)
        shapes = expected_shapes(cfg)

        def read_one(fname: str) -> Tensor | None:
            """The file's tensor fname, or the piece of a fused one (Phi-3's attn_qkv holds q, k, v; its
            ffn_up holds gate then up)."""
            part = fname.split(".")[-2]
            fused = {"attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv", "ffn_gate": "ffn_up"}
            if cfg.model_type == "phi3" and part in (*fused, "ffn_up"):
                whole = fname.replace(part, fused.get(part, part))
                if whole in gguf.tensors:
                    pieces = gguf_read.split_fused(cfg, whole, gguf_read.read_tensor(gguf, whole, cfg))
                    if fname in pieces:
                        return pieces[fname]
            return gguf_read.read_tensor(gguf, fname, cfg) if fname in gguf.tensors else None

        def read_gguf(where: Where) -> Iterator[tuple[str, Tensor]]:
            for name, want in shapes.items():
                fname = gguf_read.ours_to_gguf(name)
                full = read_one(fname)
                if full is None:
                    raise CheckpointError(f"{source.path}: missing tensor {fname}")
                check_shape(str(source.path), fname, tuple(full.shape), want)
                yield name, _cut(full, where(name)).clone()  # the full tensor is dropped here

        return cfg, read_gguf

    folder = source.path
    cfg = folder_config(folder)
    shapes = expected_shapes(cfg)
    if cfg.model_type in ("phi3", "gemma3_text"):  # fused or shifted tensors: read whole, then cut
        tensors = hf_tensors_in(cfg, read_safetensors(folder))
        names = hf_names(cfg)

        def read_whole(where: Where) -> Iterator[tuple[str, Tensor]]:
            for name, want in shapes.items():
                if names(name) not in tensors:
                    raise CheckpointError(f"{folder}: missing tensor {names(name)}")
                full = tensors[names(name)]
                check_shape(str(folder), names(name), tuple(full.shape), want)
                yield name, _cut(full, where(name)).clone()

        return cfg, read_whole
    file_name = hf_names(cfg)
    files = {}
    for f in safetensors_files(folder):
        with safe_open(f, framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), f))

    def read_folder(where: Where) -> Iterator[tuple[str, Tensor]]:
        for name, want in shapes.items():
            fname = file_name(name)
            if fname not in files:
                raise CheckpointError(f"{folder}: missing tensor {fname}")
            with safe_open(files[fname], framework="pt") as handle:
                part = handle.get_slice(fname)
                check_shape(str(folder), fname, tuple(part.get_shape()), want)
                cut = where(name)
                if cut is None:
                    yield name, part[:]
                else:
                    dim, start, stop = cut
                    yield name, part[start:stop] if dim == 0 else part[:, start:stop]

    return cfg, read_folder
