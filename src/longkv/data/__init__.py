"""Data: the texts and tokenizer shipped with longkv (bundled/), other corpus folders, reading."""
