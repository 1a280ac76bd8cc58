"""Evaluations: needle-in-a-haystack retrieval (the samples and their haystacks, the run over a
grid, its resume and its page), synthetic recall (MQAR), loss by position, and their scoring."""
