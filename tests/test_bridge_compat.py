"""Each torchax workaround in tpulab.bridge.torchax_compat, and proof its raw problem still exists.

When one of the ``test_raw_*`` tests fails, upstream fixed that problem: delete the workaround in
torchax_compat.py (and its raw test) rather than keeping dead compatibility code.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tpulab.bridge import torchax_compat


@pytest.fixture(scope="module")
def torchax():
    return torchax_compat.import_torchax()


def test_raw_import_still_fails_on_removed_named_overloads():
    p = subprocess.run(
        [sys.executable, "-c", "import torchax"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode != 0, "torchax now imports beside this torch: drop the named-overload shim"
    assert "AttributeError" in p.stderr and "has no overload name" in p.stderr, p.stderr[-500:]


def test_shim_stubs_only_overloads_torch_removed(torchax):
    assert "named-overload-shim" in torchax_compat.APPLIED
    assert 15 <= len(set(torchax_compat.STUBBED_OVERLOADS)) <= 40
    for name in set(torchax_compat.STUBBED_OVERLOADS):
        op, overload = name.split("::")[1].split(".")
        assert not hasattr(getattr(torch.ops.aten, op), overload), (
            f"{name} exists in torch: shim too broad"
        )
    # the shim is gone once torchax is imported: torch raises for missing overloads again
    with pytest.raises(AttributeError):
        torch.ops.aten.prod.dim_Dimname  # noqa: B018


def _backward_grad(env):
    model = torch.nn.Linear(3, 1)
    with env:
        model.to("jax")
        loss = torch.nn.functional.mse_loss(
            model(torch.ones(4, 3, device="jax")), torch.zeros(4, 1, device="jax")
        )
        loss.backward()
        return model.weight.grad


def test_raw_linear_override_still_bypasses_autograd(torchax):
    from torchax.tensor import Environment

    fresh = Environment()  # its own op table, untouched by enable_eager_autograd
    assert torch.nn.functional.linear in fresh._ops, (
        "torchax no longer overrides F.linear: drop enable_eager_autograd"
    )
    with pytest.raises(RuntimeError, match="does not require grad"):
        _backward_grad(fresh)


def test_eager_autograd_fix(torchax):
    from torchax.tensor import Environment

    env = Environment()
    torchax_compat.enable_eager_autograd(env)
    grad = _backward_grad(env)
    assert grad is not None and tuple(grad.shape) == (1, 3)


def test_raw_torch_save_of_torchax_tensor_still_fails(torchax, tmp_path):
    env = torchax.default_env()
    with env:
        t = torch.ones(3, device="jax")
    with pytest.raises(RuntimeError, match="not pickleable"):
        torch.save({"t": t}, tmp_path / "raw.pt")
    torch.save(torchax_compat.to_cpu({"t": t}), tmp_path / "ok.pt")
    assert torch.equal(torch.load(tmp_path / "ok.pt")["t"], torch.ones(3))
