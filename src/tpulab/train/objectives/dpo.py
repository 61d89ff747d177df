"""Direct preference optimisation against a frozen reference, full or through LoRA adapters.

The policy starts from ``objective.init`` (an SFT run; ``objective.lora`` applies as in SFT). The
reference is ``objective.reference`` (default: the same checkpoint as ``init``), read from disk as
a copy of its own: it is ``Steps.frozen["reference"]``, passed to every step, never donated, never
an alias of the policy's buffers, and checked bitwise unchanged by the loop at the end of the run.
Its identity is its checkpoint's manifest digest.

Reference log-probs (``objective.dpo.reference_logprobs``):

- ``precomputed`` (the default): the reference's log-prob of every reply of the training and
  evaluation pairs, computed once when the objective is built (one forward per batch, the same
  batch shape as a step), kept as ``Steps.frozen["reference_logprobs"]`` (row ``2 * id + side``,
  gathered through the batch's ``index``) and named by its sha256, the ``reference_logprobs``
  identity: a resume whose reference, dataset or backend gives other bytes is refused. A step
  then costs the policy's forward and backward alone (benchmarks/dpo_speed.py).
- ``online``: the reference's forward inside every step (what it costs: the same benchmark).

Step 0: with dropout off (``pairwise``), the policy at step 0 is the reference's weights, so every
log-ratio is 0 up to float32 rounding, every margin 0 and the loss ln 2 (tests/test_dpo.py states
how far float32 lets it be exact). The loss is logged as ``loss`` from step 1.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Literal

import jax
import numpy as np

from tpulab.config import check, field
from tpulab.data import preference
from tpulab.train.adapters import lora_graph
from tpulab.train.objectives import losses
from tpulab.train.objectives.frozen import load_base, model_record
from tpulab.train.objectives.pairwise import Pairwise, pair_weights, sides
from tpulab.train.registry import register_objective
from tpulab.train.step import gradient_steps, merge_model, transformer_graph, tree_digest

MAX_BETA = 100.0  # beta scales log-ratios of whole replies (tens of nats): past 100 it is a step


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimisation (Rafailov et al. 2023) and its IPO / label-smoothed forms."""

    beta: float = field(0.1, f"the KL strength beta (IPO's tau), in (0, {MAX_BETA:g}]")
    loss: Literal["sigmoid", "ipo"] = field(
        "sigmoid", "sigmoid: -log sigmoid(beta h) (DPO); ipo: (h - 1 / (2 beta))^2 (Azar et al.)"
    )
    label_smoothing: float = field(
        0.0, "sigmoid only: the chance a label is flipped (cDPO, Mitchell 2023), in [0, 0.5)"
    )
    reference_logprobs: Literal["precomputed", "online"] = field(
        "precomputed",
        "precomputed: the reference's log-probs of every pair, once per run (named by digest); "
        "online: a reference forward in every step",
    )

    def __post_init__(self):
        check(
            math.isfinite(self.beta) and 0.0 < self.beta <= MAX_BETA,
            f"objective.dpo.beta={self.beta} must be in (0, {MAX_BETA:g}]",
        )
        check(
            0.0 <= self.label_smoothing < 0.5,
            f"objective.dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5) (at 0.5 "
            "every label is a coin flip)",
        )
        check(
            self.loss == "sigmoid" or self.label_smoothing == 0.0,
            "objective.dpo.label_smoothing applies to loss=sigmoid (IPO has no label noise term)",
        )


def reference_table(graphdef, ref_params, batches) -> np.ndarray:
    """The reference's log-prob of every row of ``batches``, at the rows' ``index`` [N] float32."""
    forward = jax.jit(
        lambda p, b: losses.sequence_logprobs(
            merge_model(graphdef, p)(b["inputs"], deterministic=True), b["targets"], b["mask"]
        )
    )
    size = 1 + max(int(b["index"].max()) for b in batches)
    table = np.zeros((size,), np.float32)
    for b in batches:
        live = b["mask"].sum(axis=1) > 0
        logp = np.asarray(forward(ref_params, {k: b[k] for k in ("inputs", "targets", "mask")}))
        table[b["index"][live]] = logp[live]
    return table


@register_objective
class DPO(Pairwise):
    kind = "dpo"
    Config = DPOConfig
    uses = ("data", "reference", "lora", "init_fallback")
    needs = {"init": "the run dir of the checkpoint it starts from"}

    def __init__(self, config):
        super().__init__(config)
        self.reference = load_base(config, "reference")  # a separate read, even of init's run
        self.lora = lora_graph(config) if config.objective.lora.rank else None
        if self.lora is not None:
            print(self.lora.adapted.line(), file=sys.stderr, flush=True)
        self.plain_graphdef, _ = transformer_graph(config)
        self.table = None
        if config.objective.dpo.reference_logprobs == "precomputed":
            # on this process's default device, from a host copy: every process computes the
            # whole table itself (the same bytes: the identity says so)
            self.table = reference_table(
                self.plain_graphdef,
                jax.device_put(
                    jax.device_get(self.reference.plain_params()), jax.local_devices()[0]
                ),
                self._all_batches(),
            )

    def _all_batches(self) -> list[dict]:
        """Every training and evaluation pair once, in batches of a step's shape."""
        b = self.config.data.batch_size
        rows = np.concatenate([self.train_rows, self.eval_rows])
        return preference.eval_batches(rows, b, -(-len(rows) // b))

    def identities(self) -> dict[str, str]:
        ids = {**super().identities(), "reference": self.reference.checkpoint_digest}
        if self.table is not None:
            ids["reference_logprobs"] = tree_digest(self.table)
        return ids

    def data(self):
        source = super().data()
        source.description["reference"] = model_record(self.config, "reference", self.reference)
        return source

    def _frozen(self) -> dict:
        """A fresh host read of what stays frozen: the reference (and the LoRA base)."""
        frozen = {"reference": jax.device_get(load_base(self.config, "reference").plain_params())}
        if self.table is not None:
            frozen["reference_logprobs"] = self.table.copy()
        if self.lora is not None:
            frozen["base"] = self._base_params()
        return frozen

    def _base_params(self):
        return jax.device_get(load_base(self.config).plain_params())

    def steps(self, mesh):
        cfg, opts = self.config, self.config.objective.dpo
        plain = self.plain_graphdef
        if self.lora is None:
            graphdef, init_params = plain, transformer_graph(cfg)[1]
            policy = lambda params, frozen: merge_model(plain, params)  # noqa: E731
            load_params = self._base_params
        else:
            graphdef, init_params = self.lora.graphdef, self.lora.init_adapters
            policy = lambda params, frozen: merge_model(graphdef, params, frozen["base"])  # noqa: E731
            load_params = None

        def logps(model, batch):
            logits = model(batch["inputs"], deterministic=True)
            return losses.sequence_logprobs(logits, batch["targets"], batch["mask"])

        def reference_logps(frozen, batch):
            if "reference_logprobs" in frozen:
                return frozen["reference_logprobs"][batch["index"]]
            return jax.lax.stop_gradient(logps(merge_model(plain, frozen["reference"]), batch))

        def loss(params, frozen, batch, dropout_key):
            pi_w, pi_l = sides(logps(policy(params, frozen), batch))
            ref_w, ref_l = sides(reference_logps(frozen, batch))
            weight = pair_weights(batch["mask"])
            return losses.dpo(
                pi_w, pi_l, ref_w, ref_l, weight, opts.beta, opts.loss, opts.label_smoothing
            )

        def evaluate(params, frozen, batch):
            value, m = loss(params, frozen, batch, None)
            n = pair_weights(batch["mask"]).sum()
            out = {"val_loss": (value * n, n)}
            for name in ("reward_accuracy", "reward_margin", "kl_ref"):
                out[f"val_{name}"] = (m[name] * n, n)
            return out

        return gradient_steps(
            cfg,
            mesh,
            graphdef=graphdef,
            init_params=init_params,
            load_params=load_params,
            loss=loss,
            evaluate=evaluate,
            merge=policy,
            frozen=self._frozen(),
        )

    def describe(self, steps, state) -> dict:
        opts = self.config.objective.dpo
        out = {
            "dpo": {
                "beta": opts.beta,
                "loss": opts.loss,
                "label_smoothing": opts.label_smoothing,
                "reference_logprobs": opts.reference_logprobs,
                "reference_digest": self.reference.checkpoint_digest,
            },
            "lora": None,
        }
        if self.lora is not None:
            a = self.lora.adapted
            out["lora"] = {
                "matrices": list(a.paths),
                "adapter_params": a.adapter_params,
                "base_params": a.base_params,
            }
        return out
