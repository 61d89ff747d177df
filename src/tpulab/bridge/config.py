"""What a bridge run is: the regression problem, the MLP, the optimizer, the seed's caveats.

Backend and method are not config fields: they name *how* the same config is run, and a
checkpoint records them next to the config so a resume can refuse a foreign one.
"""

from __future__ import annotations

import dataclasses

from tpulab.config import check, field
from tpulab.errors import TpulabError

# backend -> the methods it runs. torch_xla is listed so it can be asked for by name and refused
# with a clear reason where it is not importable.
METHODS = {
    "torch": ("eager",),
    "torchax": ("eager", "jit"),
    "torch_xla": ("eager",),
}
BACKENDS = tuple(METHODS)
DTYPE = "float32"


@dataclasses.dataclass(frozen=True)
class BridgeConfig:
    """The small regression: x ~ N(0, 1) of shape (n, d), y = x.sum(1, keepdim=True).

    An MLP d->h->1 fits it with MSE and Adam.
    """

    n: int = field(256, "number of fixed training examples (full-batch training)")
    d: int = field(8, "input width")
    hidden: int = field(64, "hidden width of the MLP")
    lr: float = field(1e-2, "Adam learning rate")
    seed: int = field(0, "seed of the model init, the data and the augmentation generator")
    dropout: float = field(0.0, "dropout probability after the ReLU (0 = no dropout)")
    augment: float = field(
        0.0, "std of Gaussian noise added to x each step from the augmentation generator"
    )
    steps: int = field(200, "total optimizer steps", resume_mutable=True)
    checkpoint_every: int = field(
        10, "write a checkpoint every this many steps (and at the last step)", resume_mutable=True
    )

    def __post_init__(self):
        for name in ("n", "d", "hidden", "steps", "checkpoint_every"):
            check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        check(self.augment >= 0.0, f"augment must be >= 0, got {self.augment}")
        check(self.seed >= 0, f"seed must be >= 0, got {self.seed}")


def cli_flag(name: str) -> str:
    """The command-line flag of a BridgeConfig field (checkpoint_every -> --checkpoint-every)."""
    return "--" + name.replace("_", "-")


def check_backend_method(backend: str, method: str) -> None:
    """One-line errors for an unknown backend, an unknown method, or a method the backend lacks."""
    if backend not in METHODS:
        raise TpulabError(f"unknown backend '{backend}' (known: {', '.join(BACKENDS)})")
    if method not in METHODS[backend]:
        raise TpulabError(
            f"backend '{backend}' has no method '{method}' (it has: {', '.join(METHODS[backend])})"
        )
