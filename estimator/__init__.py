"""The memory estimator, as a layer between the backends and training: per-rank memory of a run before
it runs (estimate.py, over the backends' model-state layouts in memory_model.py and a model's traced
activations in traced_model.py), and the activation-checkpointing plan under a memory budget that
`--ckpt_policy auto` trains with (ckpt_plan.py). `python -m analysis.estimate_cli` is its command line."""
