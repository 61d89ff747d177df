"""Experiment tracking (MLflow lineage) and run-health hooks for the trainers.

Nothing here is imported by the training loop: the CLI builds the hooks and passes them to ``train()``.
mlflow itself is imported only when a tracker opens its store, so `tpulab --help` stays fast.
"""
