"""Many runs: sweeps, the runner that launches them, where they go (here or Slurm), launching, the
largest-batch search. One run is training/'s."""
