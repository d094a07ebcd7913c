"""Writing GGUF files: a (quantized) TransformerLM as llama.cpp's single file, with the `gguf` package.

    save_gguf(model, "out.gguf", qtype="q8_0", source="SmolLM2-135M-Instruct.Q4_1.gguf")

qtype is the type of the matrices inside the blocks: "f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0",
"q4_k", "q6_k", or the mix "q4_k_m" (quantize.k_quant_mix: what llama.cpp's Q4_K_M files hold).
Norm weights (1-d) are always float32, as llama.cpp keeps them.

- A float model is first quantized with quantize_model(model, qtype) for the block types, so the
  file holds exactly the model that quantize_model builds (embedding and head stay float32 unless
  quantize_head was asked for). Our Q8_0 / Q4_0 / Q4_1 / Q5_0 bytes are llama.cpp's own; the
  K-quants follow its search for scales (kquants.py).
- A quantized model is written as it is: its stored blocks go into the file byte for byte. Its
  layers must be in qtype's format (int8 / int4 / LLM.int8() / AWQ layers have no llama.cpp twin);
  "f32" / "f16" write any model dequantized.
- The architecture is the family's own in llama.cpp (`ARCHITECTURES`: llama, qwen2, qwen3, gemma3,
  phi3); any other plain model (MHA / GQA / MQA, full attention, no other switch) is written as
  llama. For llama the rows of the query and key projections are permuted into llama.cpp's
  interleaved-pair order (the inverse of gguf_read.unpermute_qk); the other architectures rotate
  halves as we do. Blocks lie within a row, so quantized rows move whole (Phi-3's fused attn_qkv
  and ffn_up are our q/k/v and gate/up rows one after the other).
- Llama 3.1's rope scaling becomes the `rope_freqs` tensor llama.cpp reads; linear and YaRN scaling
  become `rope.scaling.*` keys.
- The `{arch}.*` config keys come from the model's config; the tokenizer (and general.* names) are
  copied from `source`, a GGUF file, when given. Without one the file has no tokenizer: our loader
  reads it, llama.cpp needs one.

What llama.cpp's architecture cannot express is refused in one line (`check_exportable`): sliding
windows outside Gemma 3's own pattern, cross-layer sharing, latent attention.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from einops import rearrange
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, RopeScalingType
from torch import Tensor, nn

from cs336_inference.config import FULL, SLIDING
from cs336_inference.io.gguf_read import GEMMA3_LOCAL_BASE, GEMMA3_PATTERN, ours_to_gguf
from cs336_inference.layers import Embedding, Linear, RMSNorm, rope_frequencies
from cs336_inference.quantization import QuantizedEmbedding, QuantizedLinear, quantize_model, quantized_layers
from cs336_inference.quantization.llm_int8 import LLMInt8Linear

QTYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q5_0": (GGMLQuantizationType.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "q4_k": (GGMLQuantizationType.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "q6_k": (GGMLQuantizationType.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "q4_k_m": (GGMLQuantizationType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),  # a mix (quantize.k_quant_mix)
}
MIXES = {"q4_k_m": ("q4_k", "q6_k", "q5_0", "q8_0")}  # the formats a mix's layers may be stored in
COPIED_KEYS = ("tokenizer.", "general.name", "general.basename", "general.organization", "general.license")


def permute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Our rotate-half row order -> llama.cpp's interleaved order (rows may be raw blocks)."""
    return rearrange(w, "(n e j) d -> (n j e) d", n=n_heads, e=2)


# our model_type -> llama.cpp's architecture (other plain models are written as llama)
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}


def architecture(cfg) -> str:
    return ARCHITECTURES.get(cfg.model_type, "llama")


def check_exportable(model: nn.Module) -> None:
    """ValueError (one line) where llama.cpp's architecture for this model cannot hold it."""
    cfg = model.config
    arch = architecture(cfg)
    if arch == "gemma3":
        pattern = [SLIDING if (i + 1) % GEMMA3_PATTERN else FULL for i in range(cfg.n_layers)]
        if cfg.layer_types != pattern:
            raise ValueError(
                "llama.cpp's gemma3 makes every 6th layer global; this model's layer_types differ"
            )
        return
    if cfg.variant not in ("mha", "gqa", "mqa") and not (arch == "phi3" and cfg.variant == "sliding"):
        raise ValueError(
            f"GGUF export writes llama.cpp's {arch!r} architecture; this model is {cfg.variant!r} "
            "(sliding window, hybrid, cross-layer sharing and MLA have no equivalent there)"
        )
    if cfg.qkv_bias and arch != "qwen2":
        raise ValueError(f"GGUF export writes llama.cpp's {arch!r} architecture, which has no q/k/v biases")
    if cfg.qk_norm != (arch == "qwen3"):
        raise ValueError(
            f"llama.cpp's {arch!r} architecture {'needs' if arch == 'qwen3' else 'has no'} QK-norm"
        )
    gemma_only = [n for n in ("sandwich_norm", "embed_scale", "query_pre_attn_scalar", "rope_local_theta")
                  if getattr(cfg, n)]  # fmt: skip
    if gemma_only or cfg.mlp_act != "silu":
        raise ValueError(
            f"{(gemma_only or ['mlp_act'])[0]} is Gemma's; llama.cpp's {arch!r} has no such switch"
        )
    if cfg.partial_rotary_factor != 1.0 and arch != "phi3":
        raise ValueError(f"llama.cpp's {arch!r} architecture rotates whole heads (partial_rotary_factor)")


def _matrices(model: nn.Module) -> dict[str, nn.Module]:
    """Our state-dict name of every weight -> the module that holds it."""
    out: dict[str, nn.Module] = {"embed.weight": model.embed, "norm.weight": model.norm}
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head
    for name, module in model.layers.named_modules(prefix="layers"):
        if isinstance(module, Linear | QuantizedLinear | RMSNorm):
            out[f"{name}.weight"] = module
        if getattr(module, "bias", None) is not None:  # Qwen2's q/k/v biases
            out[f"{name}.bias"] = module
    return out


def _tensor(module: nn.Module, qtype: str, name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """What the file stores for one weight: (array, its GGML type); float arrays are [rows, cols]."""
    if name.endswith(".bias"):
        return module.bias.detach().float().cpu().contiguous().numpy(), GGMLQuantizationType.F32
    layer = module.table if isinstance(module, QuantizedEmbedding) else module
    if isinstance(layer, QuantizedLinear):
        if layer.fmt in MIXES.get(qtype, (qtype,)) and not isinstance(layer, LLMInt8Linear):
            return layer.qweight.detach().cpu().numpy(), QTYPES[layer.fmt][0]
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


def _fuse_phi3(arrays: dict, n_layers: int) -> None:
    """Phi-3's attn_qkv (q, k, v rows) and ffn_up (gate, up rows) in place of the separate tensors."""
    for i in range(n_layers):
        for fused, parts in (
            ("attn_qkv", ("attn_q", "attn_k", "attn_v")),
            ("ffn_up", ("ffn_gate", "ffn_up")),
        ):
            pieces = [arrays.pop(f"blk.{i}.{p}.weight") for p in parts]
            if len({t for _, t in pieces}) != 1:
                raise ValueError(f"layer {i}'s {' / '.join(parts)} are stored in different formats")
            arrays[f"blk.{i}.{fused}.weight"] = (np.concatenate([a for a, _ in pieces]), pieces[0][1])


def _rope_freqs(cfg) -> np.ndarray:
    """llama.cpp's rope_freqs: the divisor of each frequency, plain / scaled (Llama 3.1's scaling)."""
    if cfg.rope_freqs is not None:
        return np.asarray(cfg.rope_freqs, dtype=np.float32)
    plain, _ = rope_frequencies(cfg.rotary_dim, cfg.rope_theta)
    scaled, _ = rope_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    return (plain / scaled).numpy().astype(np.float32)


def _add_rope_scaling(writer: GGUFWriter, scaling: dict | None) -> None:
    """Linear and YaRN scaling as `rope.scaling.*` keys (llama3's goes into rope_freqs instead)."""
    kind = (scaling or {}).get("rope_type")
    if kind == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif kind == "yarn":
        if scaling.get("attention_factor") is not None or scaling.get("mscale"):
            raise ValueError("YaRN with its own attention_factor / mscale has no GGUF keys here")
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if scaling.get("beta_fast"):
            writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        if scaling.get("beta_slow"):
            writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])


def save_gguf(
    model: nn.Module, path: str | os.PathLike, qtype: str = "q8_0", source: str | os.PathLike | None = None
) -> Path:
    """Write `model` as a GGUF file of its llama.cpp architecture (see the module docstring); returns the path."""
    qtype = str(qtype).lower()
    if qtype not in QTYPES:
        raise ValueError(f"unknown GGUF type {qtype!r}; supported: {', '.join(QTYPES)}")
    check_exportable(model)
    if qtype not in ("f32", "f16") and not quantized_layers(model):
        model = quantize_model(model, qtype)
    cfg = model.config
    arch = architecture(cfg)
    arrays: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {}
    for name, module in _matrices(model).items():
        array, ggml_type = _tensor(module, qtype, name)
        heads = {"attn.q_proj.weight": cfg.n_heads, "attn.k_proj.weight": cfg.n_kv_heads}.get(
            name.split(".", 2)[-1]
        )
        if heads is not None and arch == "llama":
            array = permute_qk(torch.from_numpy(array), heads).contiguous().numpy()
        arrays[ours_to_gguf(name)] = (array, ggml_type)
    if arch == "phi3":
        _fuse_phi3(arrays, cfg.n_layers)
    if not isinstance(model.embed, Embedding | QuantizedEmbedding):
        raise ValueError(f"unexpected embedding module {type(model.embed).__name__}")
    tensors = [(name, array, ggml_type) for name, (array, ggml_type) in arrays.items()]
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3" or cfg.rope_freqs is not None:
        tensors.append(("rope_freqs.weight", _rope_freqs(cfg), GGMLQuantizationType.F32))

    path = Path(path)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    if cfg.head_dim != cfg.d_model // cfg.n_heads or arch == "gemma3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.rotary_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    _add_rope_scaling(writer, cfg.rope_scaling)
    if cfg.sliding_window is not None:
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3" and cfg.rope_local_theta != GEMMA3_LOCAL_BASE:
        writer.add_rope_freq_base_swa(cfg.rope_local_theta)
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
