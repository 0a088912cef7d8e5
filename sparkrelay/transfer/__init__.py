"""Moves a request's KV and handoff parts from the prefill stages to a decode server (rooms,
bootstrap, backends)."""
