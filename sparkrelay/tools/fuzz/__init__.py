"""HTTP fuzzing: schema-driven and hand-made hostile requests against a server; `python -m
sparkrelay.tools.fuzz`."""
