"""Models: pretrained Hugging Face LMs to fold (and, later, longkv's own language models)."""
