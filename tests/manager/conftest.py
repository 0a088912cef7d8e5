"""tests/manager: the engine's owner (sparkrelay/manager/): its typed messages, and the scheduler
process beside the HTTP server."""
