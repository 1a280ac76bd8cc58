"""Training longkv language models: data, and (to come) the training loop."""
