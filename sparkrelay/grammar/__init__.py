"""Grammar-constrained decoding: the grammar backends (llguidance, xgrammar), the compile cache that
keeps compiling off the engine loop, and the token bitmask each sampled row is masked with
(docs/structured_outputs.md)."""
