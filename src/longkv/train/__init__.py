"""Training longkv language models: the data (documents or a dataset, a held-out split, packed
rows), tokenizers, the loop (AdamW, evaluation, checkpoints, DDP/FSDP) and trained runs compared
side by side."""
