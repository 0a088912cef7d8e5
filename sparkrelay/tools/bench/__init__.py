"""Benchmarks: offline engine, HTTP serving, PD time to first token; their shared prompts and
reports."""
