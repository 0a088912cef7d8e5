"""Commands that are not serving: benchmarks, soak, fuzzing, training, the demo and its local
cluster."""
