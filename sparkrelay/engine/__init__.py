"""The engine loop (one step: handoff in, schedule, run, postprocess, handoff out) and its
construction."""
