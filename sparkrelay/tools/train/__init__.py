"""Training the bundled tiny target (target.py) and its DSpark drafter (drafter.py)."""
