"""The `longkv` command line."""
