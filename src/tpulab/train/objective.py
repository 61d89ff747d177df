"""The objective API: what a training objective gives the one loop (``tpulab.train.loop.train``).

The loop owns everything that is the same for every objective: the run dir, the checkpoint store
and its whole-state saves, resume and its identity checks, metrics.jsonl, hooks (tracking, proofs,
watchdog), preemption, evaluation cadence, the non-finite guard and the window ledger (the sha256
of every batch row it feeds). An objective owns what differs, in two parts:

- ``data()`` -> ``DataSource``: the training batches (an iterator whose position the checkpoint
  stores, so a resumed run draws exactly the batches the uninterrupted one would), the fixed
  evaluation batches, the dataset's identity and description, and a host-side check of every batch;
- ``steps(mesh)`` -> ``tpulab.train.step.Steps``: the state, its shardings and the jitted steps.
  Its state's ``params`` are what trains (the optimizer state covers them alone); what stays frozen
  is ``Steps.frozen``, passed to each step as an argument and checked unchanged at the end.

An objective also carries its own config section (``Config``, spelled ``objective.<kind>.<field>``,
validated by its own ``__post_init__``) and its rules over the shared ``objective`` settings:
``uses`` (may be set), ``needs`` (must be set, with why) and ``refuses`` (why not, where the
generic "applies to objective.kind=..." line needs one); ``check_run`` holds its rules across
sections (PPO's rollouts against data.batch_size). ``tpulab.train.registry`` registers it.

This module imports nothing of ``tpulab.train``: the registry and the run config import it.

Before the first step of a fresh run the loop asks for ``audits(steps, state)``: checks of what
the objective feeds its loss (mask counts, reduction counts, leakage),
``{name: {"passed": bool, ...}}``.
It writes them to the run's audits.json, logs them as an ``audits`` event and refuses to train when
one failed, so a curve whose audits failed is never produced. ``eval_before_training`` asks for one
evaluation of the starting parameters, logged at step 0. Step 1's record is already the loss
before the first update: ``Update`` takes the loss at the incoming parameters.

Every metric a step returns reaches metrics.jsonl, the hooks (MLflow) and the report: there is no
key list to edit. ``identities()`` names, by digest, every model and dataset the run depends on; the
loop records them in every checkpoint and refuses a resume when any of them changed.

Built for the objectives still to come as well: masked and contrastive losses on the byte model
(another ``Loss`` through ``gradient_steps``), small image models on a bundled dataset (another
model and ``DataSource``), and RL, whose batches come from environment state carried in the
checkpointed state (a ``Steps`` whose state holds it, with a ``DataSource`` that counts steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

from tpulab.evidence.ledger import eval_window_ids, window_ids

Batch = dict[str, np.ndarray]
# The settings of the run config's ``objective`` section every kind shares; an objective's
# ``uses``/``needs``/``refuses`` name them. Unset: None (``lora``: rank 0).
SHARED = ("init", "data", "reference", "reward_model", "init_fallback", "lora")


def lane_metric(name: str, lane: int) -> str:
    """The name seed ``lane`` of a run that trains seeds together logs its ``name`` under."""
    return f"{name}.seed{lane}"


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where an objective's batches come from, as the loop sees them."""

    # (process_index, process_count) -> an iterator of this process's rows of each global batch;
    # with get_state/set_state (a Grain DatasetIterator): the checkpoint stores its position.
    # None: no training iterator; the state carries its own data (a counter, an environment), each
    # step gets an empty batch, and checkpoints hold no data position (meta data_position: false).
    train: Callable[[int, int], Iterator[Batch]] | None
    eval_batches: list[Batch]  # fixed batches every process holds whole (validation)
    identity: str  # digest naming exactly what the batches are built from
    description: dict  # written to the run dir's documents.json
    check: Callable[[Batch], None] = lambda batch: (
        None
    )  # raises TpulabError on a batch unfit to train
    # what the window ledger records of each row: the byte-LM window's sha256 by default
    row_ids: Callable[[Batch], list[str]] = window_ids
    eval_row_ids: Callable[[Batch], list[str]] = eval_window_ids  # padding rows left out


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """This objective has no settings of its own."""


class Objective:
    """One training objective, registered under ``kind`` (``tpulab.train.registry``).

    Constructing one (with the ``RunConfig``) reads and verifies everything it depends on (an init
    checkpoint, a dataset) and raises a one-line error on bad input, before the loop writes
    anything. The class-level parts (``Config``, the setting rules, ``check_run``) read no file.
    """

    kind: ClassVar[str] = "?"
    Config: ClassVar[type] = NoOptions
    uses: ClassVar[tuple[str, ...]] = ()  # shared settings it may be given
    needs: ClassVar[dict[str, str]] = {}  # shared settings it must be given -> what they name
    refuses: ClassVar[dict[str, str]] = {}  # shared settings it refuses -> why (for the error)

    # evaluate the starting parameters (an ``eval`` event at step 0) before a fresh run's first step
    eval_before_training: ClassVar[bool] = False

    # resume-mutable settings whose change this objective's math depends on (dotted keys, e.g.
    # train.steps when its schedule is sized by the run's length): a resume that changes one is
    # refused as a changed config is
    fixed_on_resume: ClassVar[tuple[str, ...]] = ()

    # ``tpulab seeds``: the ``Config`` field that sets how many seeds one run trains together
    # (None: this objective does not), the per-seed metrics its steps log (``lane_metric``; the
    # first is the score curve) and the metric they are plotted against
    seeds_option: ClassVar[str | None] = None
    seed_curves: ClassVar[tuple[str, ...]] = ()
    seed_x: ClassVar[str] = "step"

    produces: ClassVar[str] = "model"  # what its checkpoints hold, for objectives that read them
    # what a checkpoint's data must have been cut by (compared on resume); None: no tokenizer
    tokenizer: ClassVar[str | None] = None

    def __init__(self, config: Any):
        self.config = config

    @property
    def options(self) -> Any:
        """This kind's own section (``config.objective.options``: an instance of ``Config``)."""
        return self.config.objective.options

    @classmethod
    def check_run(cls, config: Any) -> None:
        """Rules across the run config's sections (raise ConfigError); none by default."""

    @classmethod
    def abstract_state(cls, config: Any, mesh: Any) -> Any:
        """Shapes, dtypes and shardings of the training state, from the config alone (nothing
        computed or read): what restore, reshard and the proofs restore into."""
        raise NotImplementedError(f"{cls.__qualname__}.abstract_state")

    @classmethod
    def model_from_params(cls, config: Any, params: Any, base_params: Any = None) -> Any:
        """The model a state's ``params`` run in (``base_params``: a LoRA run's frozen base):
        what ``load_model``, ``generate`` and ``export`` use."""
        raise NotImplementedError(f"{cls.__qualname__}.model_from_params")

    @classmethod
    def plain_params(cls, restored: Any) -> Any:
        """The parameters of the plain model a restored run computes with (adapters merged, a
        value head left out): the state's params by default."""
        return restored.state.params

    @classmethod
    def seed_scores(cls, config: Any, state: Any) -> list[float]:
        """The held-out score of each seed's final policy in ``state`` (``seeds_option`` seeds,
        in lane order): what ``tpulab seeds`` aggregates."""
        raise NotImplementedError(f"{cls.__qualname__}.seed_scores")

    def run_facts(self, steps: Any, state: Any) -> dict:
        """What a run records in env.json and the tracker: ``param_count`` (the built model's),
        ``shapes`` (name -> int) and ``work`` (``unit``: tokens, images, env steps; ``per_step``:
        how many a step takes). Reads no file."""
        raise NotImplementedError(f"{type(self).__qualname__}.run_facts")

    def data(self) -> DataSource:
        raise NotImplementedError

    def steps(self, mesh: Any) -> Any:
        """A ``tpulab.train.step.Steps``: the state, its shardings and the jitted steps."""
        raise NotImplementedError

    def audits(self, steps: Any, state: Any) -> dict[str, dict]:
        """name -> ``{"passed": bool, ...what was measured}``: checks run before a fresh run's first
        step, on its starting ``state`` (never donated here). The loop writes them to audits.json
        and refuses to train when one failed. None by default."""
        return {}

    def identities(self) -> dict[str, str]:
        """name -> digest of every model and dataset this run depends on (beyond its config)."""
        return {}

    def describe(self, steps: Any, state: Any) -> dict:
        """Facts about the model for env.json and the tracker (parameter counts, bytes)."""
        return {}
