"""tests/pipeline: pipeline parallelism (sparkrelay/pipeline/): PP 2 and 4 equal PP 1, stage
capture."""
