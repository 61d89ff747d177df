"""Documents -> fixed-length windows -> a Grain pipeline whose iterator state is checkpointed.

Each document becomes ``[BOS] + bytes`` cut into windows of ``seq_len + 1`` tokens with stride
``seq_len`` (a window's last target is the next window's first input); the final window of a
document is padded with PAD and masked out of the loss. Windows never cross documents, and the
train/validation split is by whole document, so the two are disjoint by construction; any
validation window that also occurs verbatim in training (same hash) is dropped and counted.
"""

from __future__ import annotations

import dataclasses
import hashlib

import grain
import numpy as np

from tpulab.data.config import DataConfig
from tpulab.data.corpus import Corpus, Document
from tpulab.data.tokenizer import BOS, PAD, encode
from tpulab.errors import TpulabError


def document_windows(doc: Document, seq_len: int) -> np.ndarray:
    """[n, seq_len + 1] int32 windows of one document (last one PAD-filled)."""
    tokens = np.concatenate([[BOS], encode(doc.data)]).astype(np.int32)
    n = max(1, -(-(len(tokens) - 1) // seq_len))
    out = np.full((n, seq_len + 1), PAD, dtype=np.int32)
    for i in range(n):
        chunk = tokens[i * seq_len : i * seq_len + seq_len + 1]
        out[i, : len(chunk)] = chunk
    return out[(out[:, 1:] != PAD).any(axis=1)]


def window_hashes(windows: np.ndarray) -> list[str]:
    return [
        hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest()
        for row in np.ascontiguousarray(windows)
    ]


def split_documents(
    corpus: Corpus, cfg: DataConfig
) -> tuple[tuple[Document, ...], tuple[Document, ...]]:
    """(train, validation) whole documents; validation is a seeded choice of ceil(fraction * n)
    >= 1."""
    n = len(corpus.documents)
    if n < 2:
        raise TpulabError(
            f"corpus {corpus.source} has {n} document; a document-level split needs at least 2 "
            "(pass a directory of *.txt files)"
        )
    n_val = min(n - 1, max(1, int(np.ceil(cfg.val_fraction * n))))
    order = np.random.default_rng(cfg.split_seed).permutation(n)
    val_idx = set(order[:n_val].tolist())
    train = tuple(d for i, d in enumerate(corpus.documents) if i not in val_idx)
    val = tuple(d for i, d in enumerate(corpus.documents) if i in val_idx)
    return train, val


@dataclasses.dataclass(frozen=True)
class Splits:
    corpus: Corpus
    train_docs: tuple[Document, ...]
    val_docs: tuple[Document, ...]
    train_windows: np.ndarray
    val_windows: np.ndarray
    val_dropped_duplicates: int

    def describe(self) -> dict:
        doc = lambda d: {"name": d.name, "bytes": len(d.data), "sha256": d.sha256}  # noqa: E731
        return {
            "source": self.corpus.source,
            "identity": self.corpus.identity,
            "train_documents": [doc(d) for d in self.train_docs],
            "validation_documents": [doc(d) for d in self.val_docs],
            "train_windows": int(len(self.train_windows)),
            "validation_windows": int(len(self.val_windows)),
            "validation_windows_dropped_as_duplicates": self.val_dropped_duplicates,
        }


def build_splits(corpus: Corpus, cfg: DataConfig) -> Splits:
    train_docs, val_docs = split_documents(corpus, cfg)
    train_w = np.concatenate([document_windows(d, cfg.seq_len) for d in train_docs])
    val_w = np.concatenate([document_windows(d, cfg.seq_len) for d in val_docs])
    seen = set(window_hashes(train_w))
    keep = np.array([h not in seen for h in window_hashes(val_w)], dtype=bool)
    val_w = val_w[keep]
    if len(train_w) < cfg.batch_size:
        raise TpulabError(
            f"corpus has {len(train_w)} training windows, fewer than "
            f"data.batch_size={cfg.batch_size}"
        )
    if len(val_w) == 0:
        raise TpulabError("the validation documents yield no windows")
    return Splits(corpus, train_docs, val_docs, train_w, val_w, int((~keep).sum()))


# Grain's default read options (16 threads, 500 batches prefetched) fill a buffer the loop never
# reads far into: on a 35-window corpus a process burns ~3.3 CPU-s in 3 s on it (0.55 with these;
# measured here, 2 cores), and a trainer takes one batch per step. Two threads (this host's cores)
# and 16 batches keep the loop fed (data waits were 1.6% of the demo's wall) at a sixth of the CPU.
# Read options change no batch: the order is the shuffle's, whatever the threads.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)


def to_batch(windows: np.ndarray) -> dict[str, np.ndarray]:
    """[B, S+1] windows -> inputs, targets [B, S] int32 and mask [B, S] float32 (0 where the
    target is PAD)."""
    targets = windows[:, 1:]
    return {
        "inputs": windows[:, :-1],
        "targets": targets,
        "mask": (targets != PAD).astype(np.float32),
    }


def process_batches(
    rows: np.ndarray, cfg: DataConfig, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
    """The one per-process cut of a shuffled stream: this process's rows of every global batch.

    Shuffled (reshuffled each epoch) and repeated; the stream is cut into process-sized blocks and
    process p takes blocks p, p+P, p+2P, ...: global batch g is blocks gP .. gP+P-1, so the
    processes' rows of a step are disjoint and together are exactly the batch one process would
    draw (any process count, epoch boundaries included), and each process reads only its own rows.
    Windows, SFT and preference pairs and PPO's prompts are all cut by it; the caller maps each
    block to its arrays.
    """
    if cfg.batch_size % process_count:
        raise TpulabError(
            f"data.batch_size={cfg.batch_size} is not divisible by {process_count} processes"
        )
    local = cfg.batch_size // process_count
    ds = (
        grain.MapDataset.source(rows)
        .shuffle(seed=cfg.shuffle_seed)
        .repeat()
        .batch(local, drop_remainder=True)
    )
    if process_count > 1:
        ds = ds[process_index::process_count]
    return ds


def train_dataset(
    windows: np.ndarray, cfg: DataConfig, process_index: int = 0, process_count: int = 1
) -> grain.IterDataset:
    """Shuffled, repeated, batched windows; each process reads its own rows (``process_batches``).

    Its position (``next_index`` = steps taken) is the same in every process. The iterator's
    ``get_state``/``set_state`` is stored per process by the checkpoint.
    """
    ds = process_batches(windows, cfg, process_index, process_count)
    return ds.map(to_batch).to_iter_dataset(READ_OPTIONS)


def eval_batches(
    windows: np.ndarray, batch_size: int, max_batches: int
) -> list[dict[str, np.ndarray]]:
    """The fixed, unshuffled validation batches: the first ``max_batches`` full batches, or with
    fewer windows than one batch a single batch of all of them, filled up with PAD rows (mask 0:
    they add nothing to the NLL sum or the token count), so every window counts exactly once."""
    if len(windows) < batch_size:
        fill = np.full((batch_size - len(windows), windows.shape[1]), PAD, dtype=windows.dtype)
        return [to_batch(np.concatenate([windows, fill]))]
    n = min(max_batches, len(windows) // batch_size)
    return [to_batch(windows[i * batch_size : (i + 1) * batch_size]) for i in range(n)]
