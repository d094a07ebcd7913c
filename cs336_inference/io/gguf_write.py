"""Writing GGUF files: a (quantized) TransformerLM as llama.cpp's single file, with the `gguf` package.

    save_gguf(model, "out.gguf", qtype="q8_0", source="SmolLM2-135M-Instruct.Q4_1.gguf")

qtype is the type of the matrices inside the blocks: "f32", "f16", "q8_0", "q4_0" or "q4_1".
Norm weights (1-d) are always float32, as llama.cpp keeps them.

- A float model is first quantized with quantize_model(model, qtype) for the block types, so the
  file holds exactly the model that quantize_model builds (embedding and head stay float32 unless
  quantize_head was asked for). Our Q8_0 / Q4_0 / Q4_1 bytes are llama.cpp's own.
- A quantized model is written as it is: its stored blocks go into the file byte for byte. Its
  layers must be in qtype's format (int8 / int4 / LLM.int8() / AWQ layers have no llama.cpp twin);
  "f32" / "f16" write any model dequantized.
- Rows of the query and key projections are permuted into llama.cpp's interleaved-pair order
  (the inverse of gguf_read.unpermute_qk). Blocks of 32 lie within a row, so quantized rows move whole.
- The `llama.*` config keys come from the model's config; the tokenizer (and general.* names) are
  copied from `source`, a GGUF file, when given. Without one the file has no tokenizer: our loader
  reads it, llama.cpp needs one.

Only the plain llama architecture is written (MHA / GQA / MQA, no biases, full attention in every
layer): llama.cpp's "llama" has no sliding window, cross-layer sharing or latent attention.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from einops import rearrange
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from torch import Tensor, nn

from cs336_inference.io.gguf_read import ours_to_gguf
from cs336_inference.layers import Embedding, Linear, RMSNorm
from cs336_inference.quantization import QuantizedEmbedding, QuantizedLinear, quantize_model, quantized_layers
from cs336_inference.quantization.llm_int8 import LLMInt8Linear

QTYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
}
COPIED_KEYS = ("tokenizer.", "general.name", "general.basename", "general.organization", "general.license")


def permute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Our rotate-half row order -> llama.cpp's interleaved order (rows may be raw blocks)."""
    return rearrange(w, "(n e j) d -> (n j e) d", n=n_heads, e=2)


def check_exportable(model: nn.Module) -> None:
    cfg = model.config
    if cfg.variant not in ("mha", "gqa", "mqa"):
        raise ValueError(
            f"GGUF export writes llama.cpp's plain 'llama' architecture; this model is {cfg.variant!r} "
            "(sliding window, hybrid, cross-layer sharing and MLA have no 'llama' equivalent)"
        )
    if cfg.qkv_bias:
        raise ValueError("GGUF export writes llama.cpp's 'llama' architecture, which has no q/k/v biases")


def _matrices(model: nn.Module) -> dict[str, nn.Module]:
    """Our state-dict name of every weight -> the module that holds it."""
    out: dict[str, nn.Module] = {"embed.weight": model.embed, "norm.weight": model.norm}
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head
    for name, module in model.layers.named_modules(prefix="layers"):
        if isinstance(module, Linear | QuantizedLinear | RMSNorm):
            out[f"{name}.weight"] = module
    return out


def _tensor(module: nn.Module, qtype: str, name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """What the file stores for one weight: (array, its GGML type); float arrays are [rows, cols]."""
    ggml_type = QTYPES[qtype][0]
    layer = module.table if isinstance(module, QuantizedEmbedding) else module
    if isinstance(layer, QuantizedLinear):
        if layer.fmt == qtype and not isinstance(layer, LLMInt8Linear):
            return layer.qweight.detach().cpu().numpy(), ggml_type
        if qtype not in ("f32", "f16"):
            kind = "llm_int8" if isinstance(layer, LLMInt8Linear) else layer.fmt
            raise ValueError(
                f"{name} is stored as {kind}, which llama.cpp cannot read as {qtype}; export this model "
                f"as f32 / f16 (dequantized), or quantize the float model as {qtype}"
            )
        w = layer.dequantize()
    else:
        w = layer.weight.detach()
    w = w.float().cpu()
    if w.ndim == 2 and qtype == "f16":
        return w.half().contiguous().numpy(), GGMLQuantizationType.F16
    return w.contiguous().numpy(), GGMLQuantizationType.F32


def _copy_metadata(writer: GGUFWriter, source: str | os.PathLike) -> None:
    reader = GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith(COPIED_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def save_gguf(
    model: nn.Module, path: str | os.PathLike, qtype: str = "q8_0", source: str | os.PathLike | None = None
) -> Path:
    """Write `model` as a llama-architecture GGUF file (see the module docstring); returns the path."""
    qtype = str(qtype).lower()
    if qtype not in QTYPES:
        raise ValueError(f"unknown GGUF type {qtype!r}; supported: {', '.join(QTYPES)}")
    check_exportable(model)
    if qtype not in ("f32", "f16") and not quantized_layers(model):
        model = quantize_model(model, qtype)
    cfg = model.config
    tensors = []
    for name, module in _matrices(model).items():
        array, ggml_type = _tensor(module, qtype, name)
        heads = {"attn.q_proj.weight": cfg.n_heads, "attn.k_proj.weight": cfg.n_kv_heads}.get(
            name.split(".", 2)[-1]
        )
        if heads is not None:
            array = permute_qk(torch.from_numpy(array), heads).contiguous().numpy()
        tensors.append((ours_to_gguf(name), array, ggml_type))
    if not isinstance(model.embed, Embedding | QuantizedEmbedding):
        raise ValueError(f"unexpected embedding module {type(model.embed).__name__}")

    path = Path(path)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    if cfg.head_dim != cfg.d_model // cfg.n_heads:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(QTYPES[qtype][1])
    writer.add_quantization_version(2)
    if source is not None:
        _copy_metadata(writer, source)
    else:
        if cfg.bos_token_id is not None:
            writer.add_bos_token_id(cfg.bos_token_id)
        if cfg.eos_token_ids:
            writer.add_eos_token_id(cfg.eos_token_ids[0])
    for gguf_name, array, ggml_type in tensors:
        if ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, array, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
