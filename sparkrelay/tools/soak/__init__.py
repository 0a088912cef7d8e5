"""The soak: a PD deployment under load for minutes, with a verdict; `python -m
sparkrelay.tools.soak`."""
