"""Pretraining: next-byte prediction over fixed windows of the corpus, from a random init."""

from __future__ import annotations

from tpulab.data.contract import load_checked
from tpulab.data.pipeline import Splits, build_splits, eval_batches, train_dataset
from tpulab.train.objective import DataSource
from tpulab.train.objectives.lm import LanguageModel
from tpulab.train.registry import register_objective
from tpulab.train.step import make_steps


@register_objective
class Pretrain(LanguageModel):
    kind = "pretrain"
    refuses = {
        "init": "pretraining starts from a random init",
        "data": "pretraining reads data.path",
        "init_fallback": "it follows objective.init, and pretraining has none",
        "lora": "pretraining trains every parameter",
    }

    def __init__(self, config):
        super().__init__(config)
        self.splits: Splits = build_splits(load_checked(config.data), config.data)

    def data(self) -> DataSource:
        cfg, splits = self.config, self.splits
        return DataSource(
            train=lambda index, count: iter(
                train_dataset(splits.train_windows, cfg.data, index, count)
            ),
            eval_batches=eval_batches(
                splits.val_windows, cfg.data.batch_size, cfg.train.eval_batches
            ),
            identity=splits.corpus.identity,
            description=splits.describe(),
        )

    def steps(self, mesh):
        return make_steps(self.config, mesh)
