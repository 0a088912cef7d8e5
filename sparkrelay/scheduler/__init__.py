"""Torch-free scheduling: requests, the KV block manager, the scheduler and the stop rules."""
