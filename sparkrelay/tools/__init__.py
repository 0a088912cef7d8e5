"""Offline tools: training the bundled models."""
