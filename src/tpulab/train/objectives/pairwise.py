"""What the preference objectives (reward, dpo) share: the init model and the pairs they train on.

The model starts from the newest verified checkpoint of ``objective.init`` (an SFT run; its
manifest digest is the ``base`` identity). The pairs are ``objective.data``: null = natural pairs
from the plays, a directory ``tpulab pairs`` wrote, or a JSONL file (``tpulab.data.preference``);
their identity is the ``dataset`` identity. Each batch holds ``data.batch_size`` pairs as
``2 * batch_size`` rows, chosen then rejected (``preference.to_batch``).

Both preference objectives train with dropout off (``deterministic=True``), as TRL's
``DPOConfig`` and ``RewardConfig`` do by default (``disable_dropout=True``): with dropout the
policy at step 0 would not compute what its reference computes, and the rewards of a pair would
carry two different masks.
"""

from __future__ import annotations

from tpulab.data import preference
from tpulab.data.contract import load_checked
from tpulab.train.objective import DataSource
from tpulab.train.objectives.frozen import load_base, model_record
from tpulab.train.objectives.lm import LanguageModel


def pair_weights(mask_bt):
    """[B] 1.0 for a real pair, 0.0 for a padding pair, from the [2B] rows' masks (NumPy or JAX)."""
    return (mask_bt.sum(axis=-1) > 0).reshape(-1, 2)[:, 0].astype("float32")


def sides(x_b):
    """[2B, ...] rows -> (chosen [B, ...], rejected [B, ...])."""
    pairs = x_b.reshape(-1, 2, *x_b.shape[1:])
    return pairs[:, 0], pairs[:, 1]


class Pairwise(LanguageModel):
    def __init__(self, config):
        super().__init__(config)
        self.base = load_base(config)
        obj, data = config.objective, config.data
        corpus = load_checked(data) if obj.data is None else None
        self.prefs = preference.load(obj.data, corpus, data)
        self.train_rows = preference.encode(self.prefs.train, data.seq_len)
        self.eval_rows = preference.encode(self.prefs.eval, data.seq_len)

    def identities(self) -> dict[str, str]:
        return {"base": self.base.checkpoint_digest, "dataset": self.prefs.identity}

    def data(self) -> DataSource:
        cfg = self.config
        return DataSource(
            train=lambda index, count: iter(
                preference.train_dataset(self.train_rows, cfg.data, index, count)
            ),
            # eval pair ids follow the training ones: one table covers both (reference log-probs)
            eval_batches=preference.eval_batches(
                self.eval_rows, cfg.data.batch_size, cfg.train.eval_batches, len(self.train_rows)
            ),
            identity=self.prefs.identity,
            description={
                **self.prefs.describe(),
                "base": model_record(self.config, "init", self.base),
            },
            check=preference.check_batch,
        )
