"""The one table between tpulab's parameters and the PyTorch twin's, both directions, and the torch
file that carries a converted model.

Each ``Entry`` names a tpulab parameter (its ``nnx.State`` path, dotted), the twin's state-dict
name and whether the array is transposed on the way: a tpulab ``Dense`` kernel is ``[in, out]``,
a ``torch.nn.Linear`` weight ``[out, in]``; embeddings and norm scales are copied as they are.
``{i}`` stands for each block. Every name of both sides must appear exactly once: a tensor missing
or left over is refused by name, as is one whose shape is not the one its entry gives.

The torch file (``torch.save`` of a plain dict, read back with ``weights_only=True``) describes
itself: its format, the model config and norm epsilon the twin is built from, the tpulab run config
that turns it back into a run, where it came from, the conversion's check, and a sha256 of every
tensor's bytes, so a changed tensor is refused by name before anything is built from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
from pathlib import Path

import numpy as np
import torch

from tpulab.bridge.twin import TorchTransformer
from tpulab.config import from_dict, to_dict
from tpulab.errors import ConfigError, TpulabError
from tpulab.model.config import ModelConfig
from tpulab.model.transformer import NORM_EPS

FORMAT = "tpulab.torch-twin/1"


@dataclasses.dataclass(frozen=True)
class Entry:
    flax: str  # the tpulab parameter, e.g. "blocks.{i}.attn.qkv.kernel"
    torch: str  # the twin's state-dict name, e.g. "blocks.{i}.attn.qkv.weight"
    transpose: bool  # [in, out] <-> [out, in]
    untied_only: bool = False  # exists only when model.tie_embeddings is false


TABLE: tuple[Entry, ...] = (
    Entry("embed.embedding", "embed.weight", False),
    Entry("blocks.{i}.attn_norm.scale", "blocks.{i}.attn_norm.weight", False),
    Entry("blocks.{i}.attn.qkv.kernel", "blocks.{i}.attn.qkv.weight", True),
    Entry("blocks.{i}.attn.out.kernel", "blocks.{i}.attn.out.weight", True),
    Entry("blocks.{i}.mlp_norm.scale", "blocks.{i}.mlp_norm.weight", False),
    Entry("blocks.{i}.mlp.up.kernel", "blocks.{i}.mlp.up.weight", True),
    Entry("blocks.{i}.mlp.down.kernel", "blocks.{i}.mlp.down.weight", True),
    Entry("final_norm.scale", "final_norm.weight", False),
    Entry("head.kernel", "head.weight", True, untied_only=True),
)


def rows(cfg: ModelConfig, table: tuple[Entry, ...] = TABLE) -> list[tuple[str, str, bool]]:
    """(flax name, torch name, transpose) for every parameter of a model of ``cfg``."""
    out = []
    for e in table:
        if e.untied_only and cfg.tie_embeddings:
            continue
        blocks = range(cfg.n_layers) if "{i}" in e.flax else (None,)
        for i in blocks:
            out.append((e.flax.format(i=i), e.torch.format(i=i), e.transpose))
    return out


def _same_names(have, want, what: str) -> None:
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing:
        raise TpulabError(f"{what} lacks tensor {missing[0]} (the conversion table needs it)")
    if extra:
        raise TpulabError(f"{what} has tensor {extra[0]}, which the conversion table does not map")


def _check_shape(name: str, shape, want, what: str) -> None:
    if tuple(shape) != tuple(want):
        raise TpulabError(
            f"{what}: tensor {name} has shape {list(shape)}, the config makes it {list(want)}"
        )


def to_torch(
    flat: dict[str, np.ndarray], cfg: ModelConfig, table: tuple[Entry, ...] = TABLE
) -> dict[str, torch.Tensor]:
    """tpulab parameters (dotted name -> array) as the twin's state dict (fresh copies)."""
    entries = rows(cfg, table)
    _same_names(flat, [f for f, _, _ in entries], "the tpulab model")
    out = {}
    for f, t, transpose in entries:
        a = np.asarray(flat[f])
        out[t] = torch.from_numpy(np.ascontiguousarray(a.T if transpose else a).copy())
    return out


def from_torch(
    sd: dict[str, torch.Tensor],
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    table: tuple[Entry, ...] = TABLE,
    what: str = "the torch state dict",
) -> dict[str, np.ndarray]:
    """The twin's state dict as tpulab parameters (dotted name -> float32 array); ``shapes`` are
    the tpulab model's own, so a tensor of another shape is refused by name."""
    entries = rows(cfg, table)
    _same_names(sd, [t for _, t, _ in entries], what)
    _same_names(shapes, [f for f, _, _ in entries], "the tpulab model")
    out = {}
    for f, t, transpose in entries:
        x = sd[t]
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            raise TpulabError(f"{what}: tensor {t} is not a float32 tensor")
        want = shapes[f][::-1] if transpose else shapes[f]
        _check_shape(t, x.shape, want, what)
        a = x.detach().numpy()
        out[f] = np.ascontiguousarray(a.T if transpose else a).copy()
    return out


def _check_tensors(sd: dict, twin, what: str) -> None:
    """``sd`` holds exactly the twin's tensors, float32, of the twin's shapes; else one line
    naming the first that is not."""
    want = {k: tuple(v.shape) for k, v in twin.state_dict().items()}
    _same_names(sd, want, what)
    for name, x in sd.items():
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            raise TpulabError(f"{what}: tensor {name} is not a float32 tensor")
        _check_shape(name, x.shape, want[name], what)


def load_twin(sd: dict[str, torch.Tensor], cfg: ModelConfig, eps: float, what: str):
    """The twin of ``cfg`` (norm epsilon ``eps``) holding ``sd``, checked name by name first."""
    twin = TorchTransformer(cfg, eps)
    _check_tensors(sd, twin, what)
    twin.load_state_dict(sd, strict=True)
    return twin.eval()


def tensor_sha256(x: torch.Tensor) -> str:
    return hashlib.sha256(x.detach().contiguous().numpy().tobytes()).hexdigest()


def torch_file_bytes(sd: dict[str, torch.Tensor], cfg: ModelConfig, header: dict) -> bytes:
    """The bytes of a self-describing torch file (written by the caller, atomically)."""
    doc = {
        "format": FORMAT,
        "model_config": to_dict(cfg),
        **header,
        "sha256": {k: tensor_sha256(v) for k, v in sd.items()},
        "state_dict": sd,
    }
    buf = io.BytesIO()
    torch.save(doc, buf)
    return buf.getvalue()


@dataclasses.dataclass(frozen=True)
class TorchFile:
    model: ModelConfig
    norm_eps: float
    state_dict: dict[str, torch.Tensor]
    header: dict  # every other field, as written


def read_torch_file(path: Path) -> TorchFile:
    """A torch file of ``torch_file_bytes``, with its names, shapes and checksums checked
    against its own config; one-line refusals naming the tensor."""
    what = f"torch file {path}"
    if not Path(path).is_file():
        raise TpulabError(f"{what} does not exist")
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle, zip or torch error: the file is not one we wrote
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise TpulabError(f"{what} is not a readable torch file ({first})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TpulabError(f"{what} is not a {FORMAT} file (no such 'format' field)")
    for key in ("model_config", "norm_eps", "sha256", "state_dict"):
        if key not in doc:
            raise TpulabError(f"{what} lacks its '{key}' field")
    try:
        cfg = from_dict(ModelConfig, doc["model_config"])
    except (ConfigError, TypeError) as e:
        raise TpulabError(f"{what}: its model config is refused: {e}") from None
    sd, sums = doc["state_dict"], doc["sha256"]
    if not isinstance(sd, dict) or not isinstance(sums, dict):
        raise TpulabError(f"{what}: 'state_dict' and 'sha256' must be mappings")
    _check_tensors(sd, TorchTransformer(cfg, NORM_EPS), what)
    for name, x in sd.items():
        if sums.get(name) != tensor_sha256(x):
            raise TpulabError(f"{what}: tensor {name} does not match its recorded sha256")
    eps = doc["norm_eps"]
    if not isinstance(eps, float) or not eps > 0:
        raise TpulabError(f"{what}: norm_eps={eps!r} must be a positive float")
    rest = {k: v for k, v in doc.items() if k not in ("state_dict", "sha256", "model_config")}
    return TorchFile(cfg, eps, sd, rest)
