"""tests/toplevel: the top-level modules (config.py and envs.py's knobs, host.py) and the one-way
import rule."""
