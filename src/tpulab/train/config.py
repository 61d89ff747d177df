"""The Transformer run's config tree, ``RunConfig`` (its fields, checks and loader come from
``tpulab.config``). Shipped configs live in configs/*.yaml."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

from tpulab.checkpoint.rundir import METRICS
from tpulab.config import INT32_MAX, UINT32_MAX, check, check_int, check_path, field, nested
from tpulab.data.config import DataConfig
from tpulab.errors import ConfigError
from tpulab.model.config import ModelConfig, PrecisionConfig

MIN_NORMAL_FLOAT32 = 2.0**-126  # also bfloat16's: the two share an exponent range


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, cosine decay and global-norm clipping."""

    lr: float = field(3e-3, "peak learning rate")
    warmup_steps: int = field(50, "linear warmup from 0 to lr")
    schedule_steps: int = field(
        300, "cosine decay horizon (steps); lr stays at its floor afterwards"
    )
    min_lr_ratio: float = field(0.1, "floor of the cosine decay, as a fraction of lr")
    b1: float = field(0.9, "Adam first-moment decay")
    b2: float = field(0.99, "Adam second-moment decay")
    eps: float = field(1e-8, "Adam epsilon")
    weight_decay: float = field(0.1, "decoupled weight decay on matrices (not on norms)")
    clip_norm: float = field(1.0, "global gradient-norm clip; 0 disables")

    def __post_init__(self):
        check(self.lr > 0, f"optim.lr={self.lr} must be positive")
        check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        check(
            self.schedule_steps > self.warmup_steps,
            f"optim.schedule_steps={self.schedule_steps} must exceed "
            f"optim.warmup_steps={self.warmup_steps}",
        )
        check(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]",
        )
        check(
            0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0,
            f"optim.b1/b2 ({self.b1}, {self.b2}) must be in [0, 1)",
        )
        check(
            self.eps >= MIN_NORMAL_FLOAT32,
            f"optim.eps={self.eps} must be >= {MIN_NORMAL_FLOAT32:.3g} (smaller "
            "values flush to 0 in float32 and bfloat16, and Adam divides 0 by 0)",
        )
        check(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        check(self.clip_norm >= 0, f"optim.clip_norm={self.clip_norm} must be >= 0")
        check_int(
            self.warmup_steps, "optim.warmup_steps", 0, INT32_MAX - 1, "optax counts steps in int32"
        )
        check_int(
            self.schedule_steps, "optim.schedule_steps", 1, INT32_MAX, "optax counts steps in int32"
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How long to train and what to log: none of it changes the math (may change on resume)."""

    steps: int = field(300, "train until this step", resume_mutable=True)
    log_every: int = field(
        10, f"progress-bar refresh interval ({METRICS} gets every step)", resume_mutable=True
    )
    eval_every: int = field(
        50, "validation loss interval (and at the last step)", resume_mutable=True
    )
    eval_batches: int = field(8, "fixed validation batches per evaluation", resume_mutable=True)
    crash_on_nan: bool = field(True, "stop with an error on a non-finite loss", resume_mutable=True)

    def __post_init__(self):
        check(self.steps > 0, f"train.steps={self.steps} must be positive")
        check(self.log_every > 0, f"train.log_every={self.log_every} must be positive")
        check(self.eval_every > 0, f"train.eval_every={self.eval_every} must be positive")
        check(self.eval_batches > 0, f"train.eval_batches={self.eval_batches} must be positive")
        check_int(self.steps, "train.steps", 1, INT32_MAX, "steps are counted in int32")
        for name in ("log_every", "eval_every", "eval_batches"):
            check_int(getattr(self, name), f"train.{name}", 1, INT32_MAX)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing: cadence and retention (may change on resume)."""

    save_every: int = field(
        50, "save a checkpoint every this many steps (and at the end)", resume_mutable=True
    )
    keep: int = field(3, "keep the newest N checkpoints", resume_mutable=True)
    async_save: bool = field(
        True, "write checkpoints in the background while training continues", resume_mutable=True
    )

    def __post_init__(self):
        check(self.save_every > 0, f"checkpoint.save_every={self.save_every} must be positive")
        check(
            self.keep >= 2,
            f"checkpoint.keep={self.keep} must be >= 2 (a corrupt newest one needs a fallback)",
        )
        check_int(self.save_every, "checkpoint.save_every", 1, INT32_MAX)
        check_int(self.keep, "checkpoint.keep", 2, INT32_MAX)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh: batch split over data x fsdp, parameters and Adam moments split over fsdp.

    Part of the run's identity (the layout changes the reduction order, hence the bits); moving a
    checkpoint to another layout is ``tpulab reshard``.
    """

    data: int = field(
        0, "data-parallel size; 0 = every device that fsdp leaves (the default: all devices)"
    )
    fsdp: int = field(1, "fully-sharded size: parameters and both Adam moments are split over it")

    def __post_init__(self):
        check(
            self.data >= 0, f"mesh.data={self.data} must be >= 0 (0 = all devices not used by fsdp)"
        )
        check(self.fsdp >= 1, f"mesh.fsdp={self.fsdp} must be >= 1")


# The objectives the one loop trains (tpulab.train.objectives); each is a kind here.
ObjectiveKind = Literal["pretrain", "sft", "reward", "dpo", "ppo"]
# The projection paths a LoRA target pattern is searched in: blocks/<i>/attn/qkv, .../mlp/down.
LORA_DEFAULT_TARGETS = ("attn/qkv", "attn/out", "mlp/up", "mlp/down")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the projections the targets name: x W + (alpha / rank) x A B, B = 0."""

    rank: int = field(0, "adapter rank r; 0 = no adapters (full fine-tuning)")
    alpha: float = field(16.0, "adapter scale numerator: the update is (alpha / rank) * A @ B")
    targets: tuple[str, ...] = field(
        LORA_DEFAULT_TARGETS,
        "regular expressions searched in each projection's path (blocks/0/attn/qkv, ...); "
        "a pattern that matches no projection is an error",
    )

    def __post_init__(self):
        check_int(self.rank, "objective.lora.rank", 0, 2**16)
        check(self.alpha > 0, f"objective.lora.alpha={self.alpha} must be positive")
        check(len(self.targets) > 0, "objective.lora.targets must name at least one projection")
        for t in self.targets:
            try:
                re.compile(t)
            except re.error as e:
                raise ConfigError(
                    f"objective.lora.targets: {t!r} is not a regular expression ({e})"
                ) from None


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


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The reward model's Bradley-Terry loss: -log sigmoid(r_w - r_l - margin) + c (r_w + r_l)^2."""

    margin: float = field(0.0, "a constant margin the chosen reward must clear (Llama 2), >= 0")
    centering: float = field(
        0.0, "coefficient c of the centring term (Eisenstein et al. 2023): rewards near 0, >= 0"
    )

    def __post_init__(self):
        check(self.margin >= 0.0, f"objective.reward.margin={self.margin} must be >= 0")
        check(self.centering >= 0.0, f"objective.reward.centering={self.centering} must be >= 0")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO-RLHF (Schulman et al. 2017; Ziegler et al. 2019): a round samples ``rollouts`` replies
    through the compiled generation loop, scores them, then takes ``epochs x minibatches`` updates,
    one per loop step."""

    rollouts: int = field(
        16,
        "replies sampled per round: a multiple of data.batch_size (each "
        "prompt of the round's batch is sampled rollouts / batch_size times)",
    )
    max_new: int = field(32, "reply bytes sampled at most (the stop byte ends a reply early)")
    temperature: float = field(
        1.0,
        "sampling temperature, in [0.001, 10]; the trainer's "
        "log-probs use the same (softmax(logits / t))",
    )
    epochs: int = field(2, "passes over a round's rollouts")
    minibatches: int = field(2, "minibatches per epoch: each is one loop step (one update)")
    clip: float = field(
        0.2, "policy clip range epsilon: ratios clipped to [1 - eps, 1 + eps], in (0, 1)"
    )
    value_clip: float = field(
        0.2,
        "value clip range: a value moves at most this far from its rollout value per round, > 0",
    )
    gamma: float = field(1.0, "discount gamma of GAE, in [0, 1]")
    lam: float = field(0.95, "GAE lambda, in [0, 1]")
    kl_coef: float = field(0.05, "per-token KL penalty beta against the frozen reference, >= 0")
    kl_estimator: Literal["k1", "k3"] = field(
        "k1",
        "the per-token KL in the penalty: k1 = log(p / p_ref), k3 = (r - 1) - log r with "
        "r = p_ref / p (Schulman 2020)",
    )
    entropy_coef: float = field(0.0, "entropy bonus coefficient, >= 0")
    vf_coef: float = field(0.1, "value-loss coefficient, >= 0")

    def __post_init__(self):
        from tpulab.model.config import MAX_TEMPERATURE, MIN_TEMPERATURE

        for name in ("rollouts", "max_new", "epochs", "minibatches"):
            check_int(getattr(self, name), f"objective.ppo.{name}", 1, 2**16)
        for name in (
            "temperature",
            "clip",
            "value_clip",
            "gamma",
            "lam",
            "kl_coef",
            "entropy_coef",
            "vf_coef",
        ):
            value = getattr(self, name)
            check(
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value),
                f"objective.ppo.{name}={value!r} must be a finite number",
            )
        t = self.temperature
        check(
            MIN_TEMPERATURE <= t <= MAX_TEMPERATURE,
            f"objective.ppo.temperature={t} must be in [{MIN_TEMPERATURE:g}, "
            f"{MAX_TEMPERATURE:g}] (PPO samples: 0, greedy, has no log-probabilities)",
        )
        check(0.0 < self.clip < 1.0, f"objective.ppo.clip={self.clip} must be in (0, 1)")
        check(self.value_clip > 0.0, f"objective.ppo.value_clip={self.value_clip} must be > 0")
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            check(0.0 <= value <= 1.0, f"objective.ppo.{name}={value} must be in [0, 1]")
        for name in ("kl_coef", "entropy_coef", "vf_coef"):
            value = getattr(self, name)
            check(value >= 0.0, f"objective.ppo.{name}={value} must be >= 0")
        check(
            self.rollouts % self.minibatches == 0,
            f"objective.ppo.rollouts={self.rollouts} is not divisible by "
            f"objective.ppo.minibatches={self.minibatches}",
        )

    @property
    def steps_per_round(self) -> int:
        return self.epochs * self.minibatches


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """What the loop optimises. Paths may move between a run and its resume; what they hold may not:
    the digests of the checkpoints and datasets they name are the run's identity."""

    kind: ObjectiveKind = field(
        "pretrain",
        "pretrain (next byte) | sft (response-only loss) | reward (Bradley-Terry reward model) | "
        "dpo (direct preference optimisation) | ppo (PPO-RLHF)",
    )
    init: str | None = field(
        None,
        "run dir whose newest verified checkpoint the model starts from (sft, ppo: required)",
        resume_mutable=True,
    )
    data: str | None = field(
        None,
        "sft: null = the built-in dialogue set cut from the corpus's plays; or a JSONL file of "
        '{"prompt": ..., "response": ...} lines (ppo: their prompts). reward, dpo: null = natural '
        'pairs from the plays; a directory from tpulab pairs; or a JSONL file of {"prompt", '
        '"chosen", "rejected"} lines',
        resume_mutable=True,
    )
    reference: str | None = field(
        None,
        "dpo, ppo: the run dir of the frozen reference (null = the same checkpoint as init, "
        "loaded as a separate copy)",
        resume_mutable=True,
    )
    reward_model: str | None = field(
        None,
        "ppo: the run dir of the frozen reward model it scores with (required)",
        resume_mutable=True,
    )
    init_fallback: Literal["warn", "refuse"] | None = field(
        None,
        "when a run that init, reference or reward_model names has a newest checkpoint that fails "
        "verification: warn (start from its newest verified step, with a warning line recorded "
        "in the run's environment record and MLflow) | refuse (one line, nothing written) | "
        "null (warn; refuse in the trainers that prove-resume, chaos, scaleout, posttrain and "
        "the capstone start)",
        resume_mutable=True,
    )
    lora: LoraConfig = nested(LoraConfig)
    dpo: DPOConfig = nested(DPOConfig)
    reward: RewardConfig = nested(RewardConfig)
    ppo: PPOConfig = nested(PPOConfig)

    def __post_init__(self):
        for key in ("init", "data", "reference", "reward_model"):
            if getattr(self, key) is not None:
                check_path(getattr(self, key), f"objective.{key}")
        # A field another kind owns is an error, never silently ignored.
        for key, owners, unset in (
            ("reference", ("dpo", "ppo"), None),
            ("dpo", ("dpo",), DPOConfig()),
            ("reward", ("reward",), RewardConfig()),
            ("reward_model", ("ppo",), None),
            ("ppo", ("ppo",), PPOConfig()),
        ):
            check(
                self.kind in owners or getattr(self, key) == unset,
                f"objective.{key} applies to objective.kind={' or '.join(owners)}, not {self.kind}",
            )
        check(
            self.kind != "reward" or self.lora.rank == 0,
            "objective.lora applies to sft and dpo; the reward model trains every parameter",
        )
        if self.kind == "ppo":
            check(
                self.reward_model is not None,
                "objective.kind=ppo needs objective.reward_model: the run dir of the reward model",
            )
            check(self.lora.rank == 0, "objective.lora applies to sft; ppo trains every parameter")
        if self.kind == "pretrain":
            check(
                self.init is None,
                "objective.init applies to sft; pretraining starts from a random init",
            )
            check(self.data is None, "objective.data applies to sft; pretraining reads data.path")
            check(
                self.init_fallback is None,
                "objective.init_fallback applies to runs with objective.init; pretraining has none",
            )
            check(
                self.lora.rank == 0,
                "objective.lora applies to sft; pretraining trains every parameter",
            )
        else:
            check(
                self.init is not None,
                f"objective.kind={self.kind} needs objective.init: the run dir of the checkpoint "
                "it starts from",
            )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a Transformer training run."""

    seed: int = field(0, "parameter init and dropout RNG seed")
    model: ModelConfig = nested(ModelConfig)
    precision: PrecisionConfig = nested(PrecisionConfig)
    data: DataConfig = nested(DataConfig)
    optim: OptimConfig = nested(OptimConfig)
    train: TrainConfig = nested(TrainConfig)
    checkpoint: CheckpointConfig = nested(CheckpointConfig)
    mesh: MeshConfig = nested(MeshConfig)
    objective: ObjectiveConfig = nested(ObjectiveConfig)

    def __post_init__(self):
        # With 32-bit JAX, PRNGKey keeps only the low 32 bits: seed 2**32 would silently equal
        # seed 0, and seeds beyond int64 crash it.
        check_int(self.seed, "seed", 0, UINT32_MAX, "a uint32: JAX's PRNGKey keeps 32 bits")
        check(
            self.data.seq_len <= self.model.max_seq_len,
            f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )
        ppo = self.objective.ppo
        if self.objective.kind == "ppo":
            check(
                ppo.rollouts % self.data.batch_size == 0,
                f"objective.ppo.rollouts={ppo.rollouts} is not a multiple of "
                f"data.batch_size={self.data.batch_size} (the prompts of a round)",
            )
            check(
                ppo.max_new <= self.data.seq_len - 4,
                f"objective.ppo.max_new={ppo.max_new} leaves no room in data.seq_len="
                f"{self.data.seq_len} for a prompt (BOS, SOH, a byte, STX: at most seq_len - 4)",
            )
        rank = self.objective.lora.rank
        check(
            rank <= self.model.d_model,
            f"objective.lora.rank={rank} exceeds the smallest adapted matrix dimension "
            f"(model.d_model={self.model.d_model})",
        )
