"""Experiment tracking (MLflow lineage) and run-health hooks for the trainers.

Split along the process boundary: ``hook`` (the ``MlflowTracker`` the trainer runs), ``protocol``
(the messages both processes exchange), ``writer`` (the helper process that makes the MLflow calls),
``store`` (URIs, opening and probing a store, listing its runs), ``lineage`` (tags and params),
``audit`` (are a job's run dirs in the store, with their metrics). ``progress`` prints plain lines.

Nothing here is imported by the training loop: the CLI builds the hooks and passes them to
``train()``. mlflow itself is imported only when a store is opened, so `tpulab --help` stays fast.
"""
