"""Where checkpoints come from and go: sources (folder, file, hub id, the default model), safetensors
and Hugging Face folders, GGUF read and write, the tokenizer and its chat template."""
