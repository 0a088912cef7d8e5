"""tests/scheduler: the scheduler (sparkrelay/scheduler/): block manager, radix cache,
scheduling."""
