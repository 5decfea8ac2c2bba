"""Training runs: the step loop, a run's life cycle, its command line, checkpoints, launching, sweeps."""
