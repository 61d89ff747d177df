"""The Transformer run's config tree, ``RunConfig`` (its fields, checks and loader come from
``tpulab.config``). Shipped configs live in configs/*.yaml."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from tpulab.checkpoint.rundir import METRICS
from tpulab.config import (
    INT32_MAX,
    UINT32_MAX,
    Sections,
    check,
    check_int,
    check_path,
    chosen,
    field,
    nested,
    section,
)
from tpulab.data.config import DataConfig
from tpulab.errors import ConfigError
from tpulab.model import families
from tpulab.model.config import ModelConfig, PrecisionConfig
from tpulab.train import registry
from tpulab.train.objective import SHARED, NoOptions

MIN_NORMAL_FLOAT32 = 2.0**-126  # also bfloat16's: the two share an exponent range


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, a cosine (or linear) decay and global-norm clipping."""

    lr: float = field(3e-3, "peak learning rate")
    warmup_steps: int = field(50, "linear warmup from 0 to lr")
    schedule_steps: int = field(
        300, "decay horizon (steps, warmup included); lr stays at its floor afterwards"
    )
    min_lr_ratio: float = field(0.1, "floor of the decay, as a fraction of lr")
    decay: Literal["cosine", "linear"] = field(
        "cosine", "shape of the decay after warmup: cosine | linear (cleanrl's PPO annealing)"
    )
    decay_every: int = field(
        1,
        "hold the lr over blocks of this many optimizer steps, the schedule read at each block's "
        "first step (cleanrl's PPO: one block per update, epochs x minibatches)",
    )
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
        check_int(self.decay_every, "optim.decay_every", 1, INT32_MAX)


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


# How ``model`` finds its dataclass: the family its ``family`` key names.
MODEL_FAMILIES = Sections("family", families.section_of, families.sections)
# How ``objective.<kind>`` finds its dataclass: the registry, which imports the built-ins first.
OBJECTIVE_SECTIONS = Sections("kind", registry.section_of, registry.sections)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """What the loop optimises: ``kind``, the settings every kind shares, the kind's own section.

    Whether a shared setting is required, allowed or refused is the objective's rule (its ``uses``,
    ``needs``, ``refuses``), checked here. Paths may move between a run and its resume; what they
    hold may not: the digests of the checkpoints and datasets they name are the run's identity.
    """

    kind: str = field(
        registry.DEFAULT_KIND,
        "a registered objective (tpulab.train.registry; the built-ins: docs/posttraining.md) or "
        "your own as package.module:Class (docs/extending.md)",
    )
    init: str | None = field(
        None,
        "run dir whose newest verified checkpoint the model starts from (required where the "
        "objective needs it)",
        resume_mutable=True,
    )
    data: str | None = field(
        None,
        "the objective's dataset instead of its built-in one: a JSONL file, or a directory "
        "from tpulab pairs (each objective says which: docs/posttraining.md)",
        resume_mutable=True,
    )
    reference: str | None = field(
        None,
        "the run dir of a frozen reference model (null = the same checkpoint as init, loaded as "
        "a separate copy)",
        resume_mutable=True,
    )
    reward_model: str | None = field(
        None,
        "the run dir of the frozen reward model the objective scores with",
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
    options: Any = section(
        OBJECTIVE_SECTIONS, "the kind's own settings, written objective.<kind>.<field>"
    )

    def plain_default(self) -> bool:
        """The default kind with nothing of this section set: valid without its class."""
        return isinstance(self.options, NoOptions) and self._nothing_set()

    def _nothing_set(self) -> bool:
        unset = all(getattr(self, k) is None for k in SHARED if k != "lora")
        return self.kind == registry.DEFAULT_KIND and unset and self.lora.rank == 0

    def __getattr__(self, name: str) -> Any:
        """``objective.<kind>``: the kind's own section, spelled in code as in YAML."""
        options = self.__dict__.get("options")
        if options is not None and name == registry.objective_class(self.kind).kind:
            return options
        raise AttributeError(f"objective has no section {name!r} (objective.kind={self.kind})")

    def __post_init__(self):
        if self.options is None and self._nothing_set():
            # The default kind takes no options and no shared settings (tests/
            # test_objective_registry.py checks it): a config that sets nothing here is valid
            # without importing an objective, so config errors still come before jax is
            # imported (tests/test_cli_errors.py).
            object.__setattr__(self, "options", NoOptions())
            return
        cls = registry.objective_class(self.kind)
        if self.options is None:
            object.__setattr__(self, "options", cls.Config())
        check(
            isinstance(self.options, cls.Config),
            f"objective.options must be a {cls.Config.__qualname__} for kind {self.kind}",
        )
        for key in ("init", "data", "reference", "reward_model"):
            if getattr(self, key) is not None:
                check_path(getattr(self, key), f"objective.{key}")
        for key in SHARED:
            given = self.lora.rank != 0 if key == "lora" else getattr(self, key) is not None
            if key in cls.needs:
                check(given, f"objective.kind={self.kind} needs objective.{key}: {cls.needs[key]}")
            elif given and key not in cls.uses:
                owners = [k for k, c in registry.registered().items() if key in (*c.uses, *c.needs)]
                why = cls.refuses.get(key)
                check(
                    False,
                    f"objective.{key} applies to objective.kind={' or '.join(owners)}, not "
                    f"{self.kind}" + (f": {why}" if why else ""),
                )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a training run."""

    seed: int = field(0, "parameter init and dropout RNG seed")
    model: Any = chosen(
        MODEL_FAMILIES,
        ModelConfig,
        "the model family's typed config, named by model.family (transformer when absent)",
    )
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
        if isinstance(self.model, ModelConfig):  # the transformer family's rules across sections
            check(
                self.data.seq_len <= self.model.max_seq_len,
                f"data.seq_len={self.data.seq_len} exceeds "
                f"model.max_seq_len={self.model.max_seq_len}",
            )
            rank = self.objective.lora.rank
            check(
                rank <= self.model.d_model,
                f"objective.lora.rank={rank} exceeds the smallest adapted matrix dimension "
                f"(model.d_model={self.model.d_model})",
            )
        # the default kind on the Transformer with nothing set has no rule left to check (and
        # importing it would import jax before a config error could be said)
        if not (self.objective.plain_default() and isinstance(self.model, ModelConfig)):
            registry.objective_class(self.objective.kind).check_run(self)
