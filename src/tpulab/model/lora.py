"""LoRA: low-rank adapters on the Transformer's projections, and their merge into plain weights.

An adapted projection computes ``x W + (alpha / r) (x A) B`` with ``A`` [d_in, r] and ``B``
[r, d_out] held as ``nnx.LoRAParam`` (a subclass of ``nnx.Param``), so one ``nnx.split`` separates
the adapters (trained) from the base (frozen). ``B`` starts at 0: at step 0 the adapter adds an
exact 0.0 to every output, and the logits equal the base model's bit for bit. The unmerged form
skips the weight gradient of every frozen ``W`` (a third of those matmuls' backward FLOPs); the
merge ``W + (alpha / r) A B`` gives a plain model for export.

Targets are regular expressions searched in each projection's path, ``blocks/<i>/attn/qkv``,
``blocks/<i>/attn/out``, ``blocks/<i>/mlp/up``, ``blocks/<i>/mlp/down``; a pattern that matches
none of them is an error that lists them (never a silent full fine-tune or a no-op).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from flax import nnx

from tpulab.errors import ConfigError
from tpulab.model.config import ModelConfig, PrecisionConfig
from tpulab.model.transformer import Dense, Transformer

PROJECTIONS = ("attn/qkv", "attn/out", "mlp/up", "mlp/down")


class Adapter(nnx.Module):
    """``(alpha / r) (x A) B`` for rows ``x`` [N, d_in]; ``A`` as torch's
    kaiming_uniform(a=sqrt(5)) (uniform in +-1/sqrt(d_in), as PEFT initialises it), ``B`` zeros."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int,
        alpha: float,
        prec: PrecisionConfig,
        *,
        rngs: nnx.Rngs,
    ):
        init_a = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
        self.a = nnx.LoRAParam(init_a(rngs.params(), (d_in, rank), prec.param_dtype))
        self.b = nnx.LoRAParam(jnp.zeros((rank, d_out), prec.param_dtype))
        self.scale = alpha / rank
        self.dtype = prec.compute_dtype

    def __call__(self, x_nd: jax.Array) -> jax.Array:
        h = x_nd.astype(self.dtype) @ self.a[...].astype(self.dtype)
        return (h @ self.b[...].astype(self.dtype)) * jnp.asarray(self.scale, self.dtype)


def projections(model: Transformer) -> dict[str, Dense]:
    """path -> every projection LoRA may adapt, in layer order."""
    out = {}
    for i, block in enumerate(model.blocks):
        mods = {
            "attn/qkv": block.attn.qkv,
            "attn/out": block.attn.out,
            "mlp/up": block.mlp.up,
            "mlp/down": block.mlp.down,
        }
        out.update({f"blocks/{i}/{name}": mods[name] for name in PROJECTIONS})
    return out


def select(model: Transformer, targets: tuple[str, ...]) -> list[str]:
    """The projection paths the targets match; an error names a pattern that matches none."""
    paths = list(projections(model))
    for t in targets:
        if not any(re.search(t, p) for p in paths):
            raise ConfigError(
                f"objective.lora.targets: {t!r} matches no projection; the projections are "
                f"{', '.join(paths[:4])}, ... ({len(paths)} in all: blocks/<i>/ + "
                f"{', '.join(PROJECTIONS)})"
            )
    return [p for p in paths if any(re.search(t, p) for t in targets)]


@dataclasses.dataclass(frozen=True)
class Adapted:
    paths: tuple[str, ...]
    adapter_params: int
    base_params: int

    def line(self) -> str:
        share = 100.0 * self.adapter_params / max(self.base_params, 1)
        return (
            f"LoRA: {len(self.paths)} matrices adapted, {self.adapter_params:,} trained parameters "
            f"({share:.2f}% of the base's {self.base_params:,})"
        )


def add_adapters(
    model: Transformer, rank: int, alpha: float, targets: tuple[str, ...], rngs: nnx.Rngs
) -> Adapted:
    """Give each targeted projection of ``model`` an adapter (in place); returns what it adapted."""
    paths = select(model, targets)
    mods = projections(model)
    for p in paths:
        d = mods[p]
        d.lora = Adapter(d.in_features, d.out_features, rank, alpha, model.prec, rngs=rngs)
    n_adapter = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    n_all = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return Adapted(tuple(paths), n_adapter, n_all - n_adapter)


def build(
    cfg: ModelConfig,
    prec: PrecisionConfig,
    rank: int,
    alpha: float,
    targets: tuple[str, ...],
    seed: int,
) -> tuple[Transformer, Adapted]:
    """A Transformer with adapters; base weights from ``seed`` (callers replace them), adapters
    from a key folded off it."""
    model = Transformer(cfg, prec, rngs=nnx.Rngs(params=seed))
    adapted = add_adapters(
        model,
        rank,
        alpha,
        targets,
        nnx.Rngs(params=jax.random.fold_in(jax.random.PRNGKey(seed), 2)),
    )
    return model, adapted


def merged_params(model: Transformer) -> nnx.State:
    """The plain Transformer's parameters with every adapter folded in: ``W + (alpha / r) A B``,
    computed in float32 and stored in the parameter dtype. Same tree as an unadapted model's."""
    deltas = {}
    for path, d in projections(model).items():
        if d.lora is not None:
            a, b = (v[...].astype(jnp.float32) for v in (d.lora.a, d.lora.b))
            deltas[f"{path}/kernel"] = (a @ b) * d.lora.scale
    _, _, base = nnx.split(model, nnx.LoRAParam, nnx.Param)

    def fold(key_path, w):
        delta = deltas.get(_path(key_path))
        return w if delta is None else (w.astype(jnp.float32) + delta).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(fold, base)


def _path(key_path) -> str:
    """``blocks/0/attn/qkv/kernel`` from a jax key path (nnx's trailing ``value`` dropped)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in key_path]
    return "/".join(parts[:-1] if parts and parts[-1] == "value" else parts)
