"""Supervised fine-tuning with a response-only loss, full or through LoRA adapters.

Starts from the newest verified checkpoint of ``objective.init`` (its manifest digest is the run's
``base`` identity: a resume onto another base is refused). The loss is the masked next-byte NLL of
pretraining, with masks that cover each response and its stop byte only
(``tpulab.data.dialogue``); its mean is over every response byte of the global batch. With
``objective.lora.rank > 0`` the state's params are the adapters alone and the base is frozen
(``Steps.frozen``): no optimizer state for it, and the loop checks its bytes unchanged at the end.
"""

from __future__ import annotations

import sys

import jax

from tpulab.data import dialogue
from tpulab.data.contract import load_checked
from tpulab.train.adapters import lora_graph
from tpulab.train.objective import DataSource
from tpulab.train.objectives.frozen import load_base, model_record
from tpulab.train.objectives.lm import LanguageModel
from tpulab.train.registry import register_objective
from tpulab.train.step import lm_steps, transformer_graph


@register_objective
class SFT(LanguageModel):
    kind = "sft"
    uses = ("data", "lora", "init_fallback")
    needs = {"init": "the run dir of the checkpoint it starts from"}

    def __init__(self, config):
        super().__init__(config)
        self.base = load_base(config)
        obj, data = config.objective, config.data
        if obj.data is None:
            self.dialogue = dialogue.from_plays(load_checked(data), data)
        else:
            self.dialogue = dialogue.from_jsonl(obj.data, data)
        self.train_rows = dialogue.encode(self.dialogue.train, data.seq_len)
        self.eval_rows = dialogue.encode(self.dialogue.eval, data.seq_len)
        self.lora = lora_graph(config) if obj.lora.rank else None
        if self.lora is not None:
            print(self.lora.adapted.line(), file=sys.stderr, flush=True)

    def identities(self) -> dict[str, str]:
        return {"base": self.base.checkpoint_digest, "dataset": self.dialogue.identity}

    def data(self) -> DataSource:
        cfg = self.config
        return DataSource(
            train=lambda index, count: iter(
                dialogue.train_dataset(self.train_rows, cfg.data, index, count)
            ),
            eval_batches=dialogue.eval_batches(
                self.eval_rows, cfg.data.batch_size, cfg.train.eval_batches
            ),
            identity=self.dialogue.identity,
            description={
                **self.dialogue.describe(),
                "base": model_record(self.config, "init", self.base),
            },
            check=dialogue.check_batch,
        )

    def _base_params(self):
        """A fresh host read of the base's parameters (merged, if it was itself adapted)."""
        return jax.device_get(load_base(self.config).plain_params())

    def steps(self, mesh):
        if self.lora is None:  # the same model and state as pretraining's, from the base
            graphdef, init_params = transformer_graph(self.config)
            return lm_steps(self.config, mesh, graphdef, init_params, load_params=self._base_params)
        graph = self.lora
        return lm_steps(
            self.config, mesh, graph.graphdef, graph.init_adapters, frozen=self._base_params()
        )

    def describe(self, steps, state) -> dict:
        if self.lora is None:
            return {"lora": None}
        a = self.lora.adapted
        return {
            "lora": {
                "matrices": list(a.paths),
                "adapter_params": a.adapter_params,
                "base_params": a.base_params,
            }
        }
