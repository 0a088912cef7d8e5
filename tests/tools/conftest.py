"""tests/tools: the tools (sparkrelay/tools/): benchmarks, the demo, the fuzzer, the soak, drafter
training."""
