"""Post-training stages that need generation (layer 8: above inference and train).

``evaluate``: an SFT run (full or LoRA) against its base on the held-out plays
(``evaluate_sft``, called by the capstone's post-training stage and ``tpulab sft-eval``;
``log_to_run`` adds its numbers to the run's MLflow run). ``pairs``: preference pairs sampled from
a policy and labelled on the gold reward (``tpulab pairs``); ``winrate``: the gold-reward win rate
of one policy's greedy replies against another's (``tpulab win-rate``).
"""

from __future__ import annotations

from tpulab.posttrain.evaluate import evaluate_sft, log_to_run, stop_budget

__all__ = ["evaluate_sft", "log_to_run", "stop_budget"]
