"""One object per (backend, method) that trains the same torch MLP: build, step, state.

A runner is built from a freshly initialised CPU model (and, on resume, the checkpointed state),
so every backend starts from bit-identical weights. ``step(x)`` runs one optimizer step on the
batch ``x`` (a CPU tensor) and returns the loss as a Python float (the float32 value, exactly).
``state()`` returns CPU tensors only, ready for torch.save.

- torch / eager: the textbook loop on the CPU.
- torchax / eager: the same textbook loop, torch autograd and torch.optim.Adam, with the model on
  the "jax" device, inside the torchax environment.
- torchax / jit: ``torchax.train.make_train_step`` (jax.value_and_grad of the torch loss) with
  ``optax.adam``, wrapped in one ``jax.jit``. Its optimizer state is optax's; it is checkpointed as
  named CPU tensors (one per optax leaf, keyed by the leaf's tree path) and restored into the tree
  ``optax.adam(lr).init(params)`` builds.
- torch_xla / eager: the textbook loop on the XLA device, where torch_xla imports.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from tpulab.bridge.config import BACKENDS, METHODS, BridgeConfig
from tpulab.errors import CheckpointError, TpulabError


def build_model(cfg: BridgeConfig) -> torch.nn.Module:
    """Linear(d, h), ReLU, [Dropout(p)], Linear(h, 1), initialised from torch's global seed."""
    torch.manual_seed(cfg.seed)
    layers = [torch.nn.Linear(cfg.d, cfg.hidden), torch.nn.ReLU()]
    if cfg.dropout > 0:
        layers.append(torch.nn.Dropout(cfg.dropout))
    layers.append(torch.nn.Linear(cfg.hidden, 1))
    return torch.nn.Sequential(*layers)


def textbook_step(model, opt, x, y) -> torch.Tensor:
    """forward, loss, zero the gradients, backward, step."""
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def torch_xla_problem() -> str | None:
    """None where torch_xla imports beside this torch; otherwise the one-line reason it cannot."""
    if importlib.util.find_spec("torch_xla") is None:
        return (
            "torch_xla is not installed here (the torch_xla backend needs a TPU VM with the "
            "torch_xla build matched to its torch); use --backend torch or --backend torchax"
        )
    try:
        importlib.import_module("torch_xla")
    except Exception as e:
        # An unmatched torch/torch_xla pair fails in many ways; name it, do not hide it.
        return (
            f"torch_xla is installed but does not import beside torch {torch.__version__}: "
            f"{type(e).__name__}: {e}"
        )
    return None


class EagerRunner:
    """The textbook loop on a torch device: torch on CPU, torchax's "jax" device, or XLA's."""

    method = "eager"

    def __init__(self, cfg: BridgeConfig, model, y, state: dict | None, backend: str):
        self.backend = backend
        self.env = None
        if backend == "torch":
            self.device = torch.device("cpu")
        elif backend == "torchax":
            from tpulab.bridge import torchax_compat

            torchax = torchax_compat.import_torchax()
            self.env = torchax.default_env()
            torchax_compat.enable_eager_autograd(self.env)
            self.device = torch.device("jax")
        elif backend == "torch_xla":
            problem = torch_xla_problem()
            if problem:
                raise TpulabError(problem)
            import torch_xla

            self.device = torch_xla.device()
        else:
            raise TpulabError(f"unknown backend '{backend}'")
        if state is not None:
            model.load_state_dict(state["model"])
        with self._ctx():
            self.model = model.to(self.device)
            self.model.train()
            self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
            if state is not None:
                _load_torch_optimizer(self.opt, state["optimizer"])
            self.y = y.to(self.device)
        self._seed_device_rng(cfg, state)

    def _ctx(self):
        import contextlib

        return self.env if self.env is not None else contextlib.nullcontext()

    def _seed_device_rng(self, cfg, state) -> None:
        """Dropout draws from the device's generator.

        That is torch's CPU one (saved by the loop), jax's key, or XLA's.
        """
        rng = (state or {}).get("device_rng")
        if self.backend == "torchax":
            import jax
            import numpy as np

            key = (
                jax.random.PRNGKey(cfg.seed + 2)
                if rng is None
                else jax.numpy.asarray(rng.numpy().astype(np.uint32))
            )
            self.env.param.prng = key
        elif self.backend == "torch_xla" and rng is not None:
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(int(rng.item()), device=self.device)

    def step(self, x_cpu: torch.Tensor) -> float:
        with self._ctx():
            loss = textbook_step(self.model, self.opt, x_cpu.to(self.device), self.y)
            if self.backend == "torch_xla":
                import torch_xla

                torch_xla.sync()
            return loss.item()

    def state(self, with_rng: bool = True) -> dict:
        from tpulab.bridge.torchax_compat import to_cpu

        with self._ctx():
            out = {
                "model": to_cpu(self.model.state_dict()),
                "optimizer": to_cpu(self.opt.state_dict()),
            }
        if with_rng and self.backend == "torchax":
            import numpy as np

            out["device_rng"] = torch.from_numpy(np.asarray(self.env.param.prng).astype(np.int64))
        elif with_rng and self.backend == "torch_xla":
            import torch_xla.core.xla_model as xm

            out["device_rng"] = torch.tensor(
                xm.get_rng_state(device=self.device), dtype=torch.int64
            )
        return out

    def describe(self) -> dict:
        if self.backend == "torchax":
            from tpulab.evidence.provenance import jax_devices

            return {"device": "jax", **jax_devices()}
        if self.backend == "torch_xla":
            import torch_xla.core.xla_model as xm

            kind = xm.xla_device_hw(self.device)
            return {
                "device": str(self.device),
                "backend": kind.lower(),
                "device_kind": kind,
                "device_count": 1,
            }
        from tpulab.evidence.provenance import cpu_model

        return {
            "device": "cpu",
            "backend": "torch-cpu",
            "device_kind": cpu_model(),
            "device_count": 1,
            "torch_threads": torch.get_num_threads(),
        }


class JitRunner:
    """torchax's functional train step under one jax.jit.

    jax.value_and_grad of the torch loss, then optax.adam.
    """

    method = "jit"
    OPTIMIZER = "optax.adam"

    def __init__(self, cfg: BridgeConfig, model, y, state: dict | None, backend: str = "torchax"):
        import jax
        import numpy as np
        import optax

        from tpulab.bridge import torchax_compat

        torchax_compat.import_torchax()  # applies the import shim first, when needed
        import torchax.interop
        import torchax.train

        self.backend = backend
        self.env = torchax.default_env()
        if state is not None:
            model.load_state_dict(state["model"])
        model.train()
        self.model = model
        self.params = {
            k: jax.numpy.asarray(v.detach().numpy()) for k, v in model.named_parameters()
        }
        self.tx = optax.adam(cfg.lr)
        self.opt_state = self.tx.init(self.params)
        self.key = jax.random.PRNGKey(cfg.seed + 2)
        if state is not None:
            self.opt_state = _optax_from_named(self.opt_state, state["optimizer"])
            if "device_rng" in state:
                self.key = jax.numpy.asarray(state["device_rng"].numpy().astype(np.uint32))
        self.y = jax.numpy.asarray(y.numpy())

        def model_fn(weights, buffers, args):
            return torch.func.functional_call(model, {**weights, **buffers}, args)

        torch_step = torchax.train.make_train_step(model_fn, F.mse_loss, self.tx)
        env = self.env

        def jax_step(params, opt_state, key, x, y):
            key, dropout_key = jax.random.split(key)
            with env.override_property(prng=dropout_key):
                loss, params, opt_state = torchax.interop.call_torch(
                    torch_step, params, {}, opt_state, (x,), y
                )
            return loss, params, opt_state, key

        # Donation saves a copy of params and optimizer state per step; the CPU client ignores it
        # (and warns).
        donate = (0, 1) if jax.default_backend() != "cpu" else ()
        self._step = jax.jit(jax_step, donate_argnums=donate)

    def step(self, x_cpu: torch.Tensor) -> float:
        import jax

        x = jax.numpy.asarray(x_cpu.numpy())
        loss, self.params, self.opt_state, self.key = self._step(
            self.params, self.opt_state, self.key, x, self.y
        )
        return float(loss)

    def state(self, with_rng: bool = True) -> dict:
        import numpy as np

        self.model.load_state_dict(
            {k: torch.from_numpy(np.array(v)) for k, v in self.params.items()}, strict=False
        )
        out = {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": {
                "implementation": self.OPTIMIZER,
                "leaves": _optax_to_named(self.opt_state),
            },
        }
        if with_rng:
            out["device_rng"] = torch.from_numpy(np.asarray(self.key).astype(np.int64))
        return out

    def describe(self) -> dict:
        from tpulab.evidence.provenance import jax_devices

        return {"device": "jax", **jax_devices()}


def _load_torch_optimizer(opt, sd) -> None:
    if not isinstance(sd, dict) or "param_groups" not in sd:
        raise CheckpointError(
            "the checkpoint's optimizer state is not a torch.optim state_dict "
            "(written by the jit method?)"
        )
    opt.load_state_dict(sd)


def _optax_to_named(opt_state) -> dict:
    import jax
    import numpy as np

    flat, _ = jax.tree_util.tree_flatten_with_path(opt_state)
    return {jax.tree_util.keystr(path): torch.from_numpy(np.array(leaf)) for path, leaf in flat}


def _optax_from_named(template, named: dict):
    import jax

    if not isinstance(named, dict) or named.get("implementation") != JitRunner.OPTIMIZER:
        raise CheckpointError(
            f"the checkpoint's optimizer state is not {JitRunner.OPTIMIZER} state "
            "(written by an eager method?)"
        )
    leaves = named["leaves"]
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [jax.tree_util.keystr(p) for p, _ in flat]
    if sorted(names) != sorted(leaves):
        raise CheckpointError(
            f"optax state in the checkpoint has leaves {sorted(leaves)[:3]}..., "
            f"expected {names[:3]}..."
        )
    return jax.tree_util.tree_unflatten(
        treedef, [jax.numpy.asarray(leaves[n].numpy()) for n in names]
    )


def make_runner(backend: str, method: str, cfg: BridgeConfig, model, y, state: dict | None):
    if method == "jit":
        return JitRunner(cfg, model, y, state, backend)
    return EagerRunner(cfg, model, y, state, backend)


def runnable() -> list[tuple[str, str]]:
    """Every (backend, method) this machine can run; torch_xla only where it imports."""
    out = [(b, m) for b in BACKENDS for m in METHODS[b] if b != "torch_xla"]
    if torch_xla_problem() is None:
        out.append(("torch_xla", "eager"))
    return out
