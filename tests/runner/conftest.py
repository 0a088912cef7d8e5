"""tests/runner: the runner's sampling (sparkrelay/runner/): the sampler's batch tensors,
penalties."""
