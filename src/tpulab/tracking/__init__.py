"""Experiment tracking (MLflow lineage) for the trainers.

Split along the process boundary: ``hook`` (the ``MlflowTracker`` the trainer runs), ``protocol``
(the messages both processes exchange), ``writer`` (the helper process that makes the MLflow calls),
``store`` (URIs, opening and probing a store, listing its runs), ``lineage`` (tags and params),
``audit`` (are a job's run dirs in the store, with their metrics). The plain progress lines live
with the step bar in ``tpulab.train.step_progress``.

Nothing here is imported by the training loop: the CLI builds the hooks and passes them to
``train()``. mlflow itself is imported only when a store is opened, so `tpulab --help` stays fast.
"""
