"""What the byte-level Transformer objectives (pretrain, sft, reward, dpo, ppo) share: the facts
of their model and data, from the config alone (no file read).

The state a checkpoint holds (a plain Transformer's, or its LoRA adapters' over a frozen base), the
model its parameters run in, and what a run records: the Transformer's shapes and built parameter
count, tokens as the unit of work (batch x seq_len per step), the byte tokenizer's definition
(checked on resume). Reward and PPO override the state and the model; the facts stay these.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from tpulab.config import check
from tpulab.data.tokenizer import DEFINITION as TOKENIZER
from tpulab.model import lora
from tpulab.model.config import ModelConfig
from tpulab.model.transformer import built_param_count
from tpulab.train.adapters import lora_graph
from tpulab.train.objective import Objective
from tpulab.train.step import make_steps, merge_model, transformer_graph

# What a run's checkpoint holds, for the objectives that read another run (``frozen``): a base or
# reference must be a language model, ``objective.reward_model`` a reward model.
LANGUAGE_MODEL, REWARD_MODEL = "language model", "reward model"


class LanguageModel(Objective):
    """The shared base of the byte-LM objectives; not registered itself."""

    tokenizer = TOKENIZER
    produces = LANGUAGE_MODEL

    @classmethod
    def check_run(cls, config) -> None:
        """The Transformer family (its rules across sections are the run config's)."""
        check(
            isinstance(config.model, ModelConfig),
            f"objective.kind={config.objective.kind} trains the transformer family, not "
            f"model.family={config.model.family}",
        )

    @classmethod
    def abstract_state(cls, config, mesh) -> Any:
        if config.objective.lora.rank:  # the adapters alone: the base is read from its own run
            return lora_graph(config).abstract_state(mesh)
        return make_steps(config, mesh).abstract_state()

    @classmethod
    def model_from_params(cls, config, params, base_params=None) -> nnx.Module:
        if base_params is not None:
            return nnx.merge(lora_graph(config).graphdef, params, base_params)
        graphdef, _ = transformer_graph(config)
        return merge_model(graphdef, params)

    @classmethod
    def plain_params(cls, restored) -> Any:
        return (
            restored.state.params if restored.base is None else lora.merged_params(restored.model)
        )

    def run_facts(self, steps, state) -> dict:
        cfg = self.config
        return {
            "param_count": built_param_count(steps.model(state.params)),
            "shapes": {
                "batch": cfg.data.batch_size,
                "seq_len": cfg.data.seq_len,
                "d_model": cfg.model.d_model,
                "n_layers": cfg.model.n_layers,
                "n_heads": cfg.model.n_heads,
                "vocab": cfg.model.vocab_size,
            },
            "work": {"unit": "tokens", "per_step": cfg.data.batch_size * cfg.data.seq_len},
        }
