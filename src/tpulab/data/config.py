"""Data pipeline settings."""

from __future__ import annotations

import dataclasses

from tpulab.config import INT32_MAX, UINT32_MAX, check, check_int, check_path, field

MAX_BATCH_SIZE = (
    2**20
)  # a sanity bound: far above any batch here, keeps batch * seq_len inside int64


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Corpus, split and batching. On resume the corpus identity (a content hash) is checked, not
    the path."""

    path: str | None = field(
        None,
        "text file or directory of *.txt; null = the shipped Shakespeare corpus",
        resume_mutable=True,
    )
    contract: str | None = field(
        None,
        "data contract JSON the corpus is checked against before step 0 (tpulab contract record); "
        "null = the shipped contract for the shipped corpus, no check for a user corpus",
        resume_mutable=True,
    )
    seq_len: int = field(
        128, "tokens per training sequence (inputs); windows hold seq_len + 1 tokens"
    )
    batch_size: int = field(16, "sequences per step (global, across processes)")
    val_fraction: float = field(
        0.1, "fraction of whole documents held out for validation (at least one)"
    )
    split_seed: int = field(0, "seed of the document-level train/validation split")
    shuffle_seed: int = field(0, "seed of the Grain window shuffle (reshuffled every epoch)")

    def __post_init__(self):
        if self.path is not None:
            check_path(self.path, "data.path")
        if self.contract is not None:
            check_path(self.contract, "data.contract")
        check(self.seq_len > 0, f"data.seq_len={self.seq_len} must be positive")
        check(self.batch_size > 0, f"data.batch_size={self.batch_size} must be positive")
        check_int(self.seq_len, "data.seq_len", 1, INT32_MAX)
        check_int(self.batch_size, "data.batch_size", 1, MAX_BATCH_SIZE)
        check(
            0.0 < self.val_fraction < 1.0,
            f"data.val_fraction={self.val_fraction} must be in (0, 1)",
        )
        # Grain refuses shuffle seeds outside uint32; the split seed gets the same range too.
        check_int(self.split_seed, "data.split_seed", 0, UINT32_MAX, "a uint32")
        check_int(
            self.shuffle_seed, "data.shuffle_seed", 0, UINT32_MAX, "a uint32, as Grain requires"
        )
