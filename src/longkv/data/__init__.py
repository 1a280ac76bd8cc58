"""Data: the public-domain corpus in ../shared/data and helpers to read it."""
