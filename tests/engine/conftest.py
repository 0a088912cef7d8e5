"""tests/engine: the engine loop (sparkrelay/engine/) in process: generation, DSpark = plain, the
prefix cache through the engine."""
