"""Post-training evaluation: what SFT (full or LoRA) changed, measured on the held-out plays.

``evaluate_sft(run_dir)`` is the one entry point (the capstone's post-training stage and
``tpulab sft-eval`` call it); ``log_to_run`` adds its numbers to the run's MLflow run.
"""

from __future__ import annotations

from tpulab.posttrain.evaluate import evaluate_sft, log_to_run, stop_budget

__all__ = ["evaluate_sft", "log_to_run", "stop_budget"]
