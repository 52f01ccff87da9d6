"""Loading models: checkpoints (safetensors, GGUF), their configs, tokenizers and chat templates."""
