"""scikit-learn's bundled 8x8 digits (1,797 images in the wheel: nothing downloaded) as a data
source: a seeded, recorded train/held-out partition and the batches cut from it.

The partition is a seeded permutation of the image indices (``data.split_seed``): the first
``ceil(data.val_fraction * n)`` are held out. Its identity hashes the builder, its parameters, the
dataset's digest and both index lists, so a run records exactly which images it trained on and a
resume with another partition is refused (the loop compares it with the checkpoint's). A batch is
``x`` [b, 8, 8] float32 in [0, 1], ``y`` [b] int32 and ``index`` [b] int32 (the image's row in the
dataset); the window ledger records each row as ``index:sha256(pixels, label)[:16]``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import numpy as np

from tpulab.data.config import DataConfig
from tpulab.data.heldout import HeldOutSet, hash_fields, identity_hash
from tpulab.data.pipeline import READ_OPTIONS, process_batches
from tpulab.errors import TpulabError

BUILDER = "sklearn-digits-partition-v1"
IMAGE_SIZE = 8
CLASSES = 10


@functools.cache
def load() -> tuple[np.ndarray, np.ndarray]:
    """(x [1797, 8, 8] float32 in [0, 1], y [1797] int32): scikit-learn's copy, scaled by 1/16."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)
    x.flags.writeable = False
    y = d.target.astype(np.int32)
    y.flags.writeable = False
    return x, y


def dataset_digest() -> str:
    """sha256 of every pixel and label: names the dataset whatever scikit-learn's version."""
    x, y = load()
    return hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()


def image_ids(index: np.ndarray) -> list[str]:
    """Each image's identity: its row in the dataset and the sha256 of its pixels and label."""
    x, y = load()
    return [
        f"{i}:{hashlib.sha256(x[i].tobytes() + y[i].tobytes()).hexdigest()[:16]}"
        for i in np.asarray(index).tolist()
    ]


@dataclasses.dataclass(frozen=True)
class DigitsPartition(HeldOutSet):
    """``train`` and ``eval``: sorted int64 index arrays into the dataset, disjoint, covering it."""

    builder = BUILDER
    unit = "images"

    def facts(self) -> dict:
        return {"images": len(self.train) + len(self.eval), "image_size": IMAGE_SIZE}


def partition(cfg: DataConfig) -> DigitsPartition:
    """The seeded partition of ``cfg`` (``split_seed``, ``val_fraction``); one line if a side would
    be smaller than a batch."""
    x, y = load()
    n = len(y)
    n_held = min(n - 1, max(1, math.ceil(cfg.val_fraction * n)))
    order = np.random.default_rng(cfg.split_seed).permutation(n)
    held, train = np.sort(order[:n_held]), np.sort(order[n_held:])
    if len(train) < cfg.batch_size:
        raise TpulabError(
            f"the digits partition leaves {len(train)} training images, fewer than "
            f"data.batch_size={cfg.batch_size} (lower data.val_fraction or the batch)"
        )
    params = {
        "split_seed": cfg.split_seed,
        "val_fraction": cfg.val_fraction,
        "dataset_sha256": dataset_digest(),
    }
    h = identity_hash(BUILDER, params)
    hash_fields(h, [train.astype("<i8").tobytes(), held.astype("<i8").tobytes()])
    return DigitsPartition(train, held, params, h.hexdigest())


def batch_of(rows: np.ndarray) -> dict[str, np.ndarray]:
    x, y = load()
    return {"x": x[rows], "y": y[rows], "index": rows.astype(np.int32)}


def train_stream(part: DigitsPartition, cfg: DataConfig, process_index: int, process_count: int):
    """This process's rows of every shuffled global batch of the training images (a Grain
    iterator: the checkpoint stores its position)."""
    ds = process_batches(part.train, cfg, process_index, process_count)
    return iter(ds.map(batch_of).to_iter_dataset(READ_OPTIONS))


def first_batch(part: DigitsPartition, cfg: DataConfig) -> dict[str, np.ndarray]:
    """The first global batch ``train_stream`` yields, read directly (no iterator started)."""
    return batch_of(process_batches(part.train, cfg)[0])


def eval_batches(rows: np.ndarray, batch_size: int) -> list[dict[str, np.ndarray]]:
    """Every image of ``rows`` once, in order, in batches of ``batch_size`` (the last filled with
    weight-0 copies of image ``rows[0]``, which count nowhere)."""
    out = []
    for i in range(0, len(rows), batch_size):
        idx = rows[i : i + batch_size]
        pad = batch_size - len(idx)
        batch = batch_of(np.concatenate([idx, np.full(pad, rows[0], idx.dtype)]))
        batch["weight"] = np.concatenate([np.ones(len(idx)), np.zeros(pad)]).astype(np.float32)
        out.append(batch)
    return out


def row_ids(batch: dict) -> list[str]:
    return image_ids(batch["index"])


def eval_row_ids(batch: dict) -> list[str]:
    return [h for h, w in zip(row_ids(batch), np.asarray(batch["weight"])) if w > 0]
