"""Evaluations: needle-in-a-haystack retrieval and scoring."""
