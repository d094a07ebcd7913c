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
}


def input_ids(vocab_size: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=g)


def build_hf_model(model_type: str, overrides: dict, seed: int = 0):
    """A random transformers model with weights large enough that every part shows in the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

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
    args = ap.parse_args()
    import transformers

    for i, (name, (model_type, overrides)) in enumerate(CASES.items()):
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


if __name__ == "__main__":
    main()
