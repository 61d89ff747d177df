"""The package faces (``tpulab``, ``tpulab.bridge``, ``tpulab.inference``): each public name is the
implementation's own object with its real signature, ``import tpulab`` imports no jax, and no public
name equals a submodule's (importing the submodule would replace it)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
import types

import pytest

import tpulab
from conftest import REPO, TINY


def _face_of_tpulab() -> dict:
    """What each public name of ``tpulab`` must be, imported here from where it is implemented."""
    from tpulab.errors import ExitCode, TpulabError
    from tpulab.model.families import register_family
    from tpulab.train.config import RunConfig
    from tpulab.train.hooks import Hooks
    from tpulab.train.loop import train
    from tpulab.train.objective import DataSource, Objective
    from tpulab.train.registry import objective_class, register_objective
    from tpulab.train.restore import load_model
    from tpulab.train.step import Steps, TrainState, gradient_steps

    return {
        "load_config": tpulab.load_config,  # defined in the face itself (checked below)
        "RunConfig": RunConfig,
        "fit": train,
        "Hooks": Hooks,
        "load_model": load_model,
        "Objective": Objective,
        "DataSource": DataSource,
        "register_objective": register_objective,
        "register_family": register_family,
        "objective_class": objective_class,
        "Steps": Steps,
        "TrainState": TrainState,
        "gradient_steps": gradient_steps,
        "TpulabError": TpulabError,
        "ExitCode": ExitCode,
    }


def _face_of_bridge() -> dict:
    from tpulab.bridge import capstone, compare, config, loop, prove

    return {
        "BACKENDS": config.BACKENDS,
        "METHODS": config.METHODS,
        "BridgeConfig": config.BridgeConfig,
        "check_backend_method": config.check_backend_method,
        "train": loop.train,
        "prove_resume": prove.prove,
        "compare_backends": compare.compare,
        "capstone_stage": capstone.capstone_stage,
    }


def _face_of_inference() -> dict:
    from tpulab.inference import (
        artifacts,
        cache_eval,
        capstone,
        export,
        generate,
        speed,
        trust,
    )

    return {
        "generate_text": generate.generate_text,
        "generate_batch": generate.generate_batch,
        "Request": generate.Request,
        "KVEvalConfig": cache_eval.KVEvalConfig,
        "write_kvcache_report": cache_eval.write_kvcache_report,
        "export_artifacts": export.export_artifacts,
        "open_artifacts": artifacts.open_artifacts,
        "verify_export": trust.verify_export,
        "load_verified": trust.load_verified,
        "decode_speed": speed.decode_speed,
        "capstone_stage": capstone.capstone_stage,
    }


def _wrappers(face: types.ModuleType) -> list[str]:
    """Public callables of ``face`` whose signature is only ``(*args, **kwargs)``."""
    out = []
    for name in face.__all__:
        obj = getattr(face, name)
        if not callable(obj) or inspect.isclass(obj):
            continue
        kinds = {p.kind for p in inspect.signature(obj).parameters.values()}
        if kinds and kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
            out.append(name)
    return out


def _shadowed(face: types.ModuleType, names) -> list[str]:
    """Public names that are also submodules of ``face``: importing one rebinds the name."""
    submodules = {m.name for m in pkgutil.iter_modules(face.__path__)}
    return sorted(set(names) & submodules)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("tpulab", _face_of_tpulab),
        ("tpulab.bridge", _face_of_bridge),
        ("tpulab.inference", _face_of_inference),
    ],
)
def test_each_public_name_is_the_implementation(name, expected):
    face = importlib.import_module(name)
    want = expected()
    assert sorted(face.__all__) == sorted(want)
    assert set(face.__all__) <= set(dir(face))
    for public, obj in want.items():
        assert getattr(face, public) is obj, public
    assert _wrappers(face) == []
    assert _shadowed(face, face.__all__) == []
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        face.nope  # noqa: B018 - the lookup is the test


def test_real_signatures():
    import tpulab.bridge
    from tpulab.bridge import loop

    fit = inspect.signature(tpulab.fit).parameters
    assert list(fit)[:2] == ["config", "run_dir"] and "hooks" in fit and "objective" in fit
    assert inspect.signature(tpulab.bridge.train) == inspect.signature(loop.train)
    assert list(inspect.signature(tpulab.bridge.prove_resume).parameters)[:3] == [
        "cfg",
        "backend",
        "method",
    ]
    assert list(inspect.signature(tpulab.load_config).parameters) == ["path", "overrides"]


def test_negative_controls_for_the_face_checks():
    """The checks above catch the two faults they exist for: a ``*args, **kwargs`` wrapper (what
    the bridge exported before) and a public name that is also a submodule (``prove``, ``compare``
    there: once ``tpulab.bridge.prove`` was imported, ``tpulab.bridge.prove`` was the module)."""
    import tpulab.bridge
    import tpulab.bridge.prove  # binds the submodule to the package attribute ``prove``

    fake = types.ModuleType("fake_face")
    fake.__all__ = ["wrapped", "real"]
    fake.wrapped = lambda *args, **kwargs: None
    fake.real = lambda cfg, *, steps=1: None
    assert _wrappers(fake) == ["wrapped"]
    assert _shadowed(tpulab.bridge, ["prove", "compare", "train", "prove_resume"]) == [
        "compare",
        "prove",
    ]
    assert isinstance(tpulab.bridge.prove, types.ModuleType)
    assert tpulab.bridge.prove_resume is tpulab.bridge.prove.prove


def test_from_import_of_a_submodule_still_works():
    from tpulab import compile_cache

    assert compile_cache.__name__ == "tpulab.compile_cache"


def test_load_config_is_the_loader_with_run_config():
    from tpulab.config import load
    from tpulab.errors import ConfigError
    from tpulab.train.config import RunConfig

    got = tpulab.load_config(TINY, ["train.steps=7"])
    assert isinstance(got, RunConfig) and got.train.steps == 7
    assert got == load(RunConfig, TINY, ["train.steps=7"])
    assert tpulab.load_config() == RunConfig()
    with pytest.raises(ConfigError, match="nope"):
        tpulab.load_config(TINY, ["train.nope=1"])


PROBE = (
    "import sys, tpulab; {touch}; "
    "print(sorted(m for m in ('jax', 'flax', 'torch') if m in sys.modules))"
)


@pytest.mark.parametrize(
    "touch, loaded",
    [
        ("dir(tpulab); tpulab.load_config; tpulab.__all__", "[]"),
        # control: the probe sees jax once a name that needs it is resolved
        ("tpulab.fit", "['flax', 'jax']"),
    ],
)
def test_import_tpulab_imports_no_jax(touch, loaded):
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(touch=touch)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == loaded, out.stderr
