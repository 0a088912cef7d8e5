"""tests/grammar: grammar-constrained decoding (sparkrelay/grammar/): the backends, the bitmask and
its kernel, the verify rows' masks, and constrained decoding through the engines."""
