"""A run described and simulated without running it: its resolution (describe.py) and rank 0 of a
world under torch's fake process group (fake_world.py)."""
