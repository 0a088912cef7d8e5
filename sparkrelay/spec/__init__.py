"""Speculative decoding: the DSpark proposer, verification (a pure function), acceptance
statistics."""
