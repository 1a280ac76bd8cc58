"""Evaluations: needle-in-a-haystack retrieval, synthetic recall (MQAR) and their scoring."""
