"""tests/models: the model code (sparkrelay/models/): attention, families against transformers,
GGUF, dummy loads, kernels, the DSpark drafter and its context projection."""
