"""What comes in: GGUF files and their quant types, the tokenizer, and where models are found."""
