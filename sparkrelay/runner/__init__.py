"""Turns a scheduled batch into tensors, runs the model, samples."""
