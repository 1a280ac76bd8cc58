"""Data: the texts and tokenizer shipped with longkv (bundled/), other corpus folders, reading;
and the label that leaves a position unscored."""

IGNORE = -100  # labels value of an unscored position (cross_entropy's ignore_index)
