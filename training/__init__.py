"""Training runs: one run: the step loop, its life cycle, its command line, checkpoints, export."""
