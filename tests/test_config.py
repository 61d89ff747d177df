import dataclasses
import re
from pathlib import Path

import pytest

from conftest import REPO, tiny_config
from tpulab.config import identity_diff, load, to_dict
from tpulab.errors import ConfigError
from tpulab.train.config import RunConfig


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path):
    if path.name.startswith("cloud."):  # a `tpulab tpu` config, not a training run
        from tpulab.cloud.config import load_cloud_config

        assert load_cloud_config(path).accelerator_type
        return
    cfg = load(RunConfig, path)
    if cfg.model.family == "transformer":  # the image families read no sequences
        assert cfg.data.seq_len <= cfg.model.max_seq_len
    else:
        assert cfg.model.image_size == 8  # the digits'


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.d_modle=64", "unknown config key 'model.d_modle'"),
        ("optim.lr=-1", "optim.lr=-1.0 must be positive"),
        ("data.seq_len=64", "data.seq_len=64 exceeds model.max_seq_len=32"),
        ("model.n_heads=3", "not divisible by model.n_heads=3"),
        ("model.n_layers=two", "must be an integer"),
        ("precision.compute_dtype=float16", "must be one of"),
        ("checkpoint.keep=1", "checkpoint.keep=1 must be >= 2"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        tiny_config(override)


def test_overrides_apply_after_file_and_types_are_checked():
    cfg = tiny_config("model.d_model=64", "optim.lr=1e-3", "data.path=null")
    assert cfg.model.d_model == 64 and cfg.optim.lr == 1e-3 and cfg.data.path is None
    assert dataclasses.is_dataclass(cfg) and isinstance(cfg.optim.lr, float)


def test_identity_ignores_step_count_logging_and_checkpoint_cadence():
    a = to_dict(tiny_config())
    b = to_dict(
        tiny_config(
            "train.steps=999", "train.log_every=1", "checkpoint.save_every=3", "data.path=/x"
        )
    )
    assert identity_diff(RunConfig, a, b) == []
    c = to_dict(tiny_config("optim.lr=0.01", "seed=5"))
    assert sorted(d.split(":")[0] for d in identity_diff(RunConfig, a, c)) == ["optim.lr", "seed"]


@pytest.mark.parametrize(
    "override",
    [
        "optim.lr=inf",
        "optim.lr=.inf",
        "optim.eps=inf",
        "optim.lr=-.inf",
        "optim.b1=nan",
        "optim.b2=.nan",
        "optim.lr=1e999",
        f"optim.clip_norm={10**400}",
        "model.rope_base=Infinity",
    ],
)
def test_non_finite_floats_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"config key '{key}' must be a finite number"):
        tiny_config(override)


def test_a_field_may_allow_non_finite_values():
    from tpulab.config import field, from_dict

    @dataclasses.dataclass(frozen=True)
    class Limits:
        hi: float = field(1.0, "upper limit; inf = none", allow_nonfinite=True)
        lo: float = field(0.0, "lower limit")

    assert from_dict(Limits, {"hi": "inf"}).hi == float("inf")
    with pytest.raises(ConfigError, match="config key 'lo' must be a finite number"):
        from_dict(Limits, {"lo": "-inf"})


def test_long_values_are_cut_in_messages():
    with pytest.raises(ConfigError) as e:
        tiny_config(f"seed={10**400}")
    assert len(str(e.value)) < 200 and "(401 characters)" in str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=-1", "seed=-1 must be in [0, 4294967295]"),
        (f"seed={2**32}", "seed=4294967296 must be in [0, 4294967295]"),
        (f"seed={10**30}", "must be in [0, 4294967295]"),
        (f"data.shuffle_seed={2**32}", "data.shuffle_seed=4294967296 must be in [0, 4294967295]"),
        ("data.split_seed=-3", "data.split_seed=-3 must be in"),
        (f"train.steps={2**31}", "train.steps=2147483648 must be in [1, 2147483647]"),
        (f"optim.schedule_steps={2**40}", "optim.schedule_steps=1099511627776 must be in"),
        (f"checkpoint.save_every={2**31}", "checkpoint.save_every=2147483648 must be in"),
        (f"model.d_model={2**20}", "model.d_model=1048576 must be in [1, 65536]"),
        (f"model.n_layers={10**30}", "must be in [1, 4096]"),
        (f"model.vocab_size={2**40}", "model.vocab_size=1099511627776 must be in [258, 1048576]"),
        (f"model.mlp_ratio={2**33}", "model.mlp_ratio=8589934592 must be in [1, 64]"),
        (f"data.batch_size={2**21}", "data.batch_size=2097152 must be in [1, 1048576]"),
        ("optim.eps=1e-40", "optim.eps=1e-40 must be >= 1.18e-38"),
        ("optim.eps=0", "optim.eps=0.0 must be >= 1.18e-38"),
        ("model.rope_base=1", "model.rope_base=1.0 must be > 1"),
        ("model.rope_base=1e-300", "model.rope_base=1e-300 must be > 1"),
        ("data.path=", "data.path must not be empty"),
        ("data.path=" + "x" * 5000, "data.path is 5000 bytes long; paths are limited to 4095"),
        ("data.path=/tmp/" + "y" * 256 + "/z", "data.path has a 256-byte name"),
    ],
)
def test_out_of_range_values_are_refused(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_config(override)


def test_bounds_admit_their_edges():
    cfg = tiny_config(
        f"seed={2**32 - 1}", f"data.shuffle_seed={2**32 - 1}", f"train.steps={2**31 - 1}"
    )
    assert cfg.seed == 2**32 - 1 and cfg.train.steps == 2**31 - 1
    assert tiny_config("seed=0").seed == 0


def test_the_seed_bound_is_what_jax_needs():
    """Why seeds are uint32: JAX's 32-bit PRNGKey keeps the low 32 bits: 2**32 collides with 0."""
    import jax
    import numpy as np

    def key(s):
        return np.asarray(jax.random.key_data(jax.random.PRNGKey(s)))

    assert (key(2**32) == key(0)).all()
    assert not (key(2**32 - 1) == key(0)).all()


def test_the_eps_bound_is_what_float32_needs():
    """Why optim.eps >= 2**-126: a subnormal eps flushes to 0; a zero-gradient param gets 0/0."""
    import jax.numpy as jnp
    import optax

    def update(eps):
        tx = optax.adam(1e-3, eps=eps)
        params = jnp.zeros(2, jnp.float32)
        return tx.update(jnp.array([0.0, 1.0], jnp.float32), tx.init(params), params)[0]

    assert jnp.isnan(update(1e-40)[0]) and bool(jnp.isfinite(update(2.0**-126)).all())
    tiny_config(f"optim.eps={2.0**-126!r}")  # the bound itself is accepted


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfe\x00\x01junk\x80", "is not UTF-8 text (byte 0xff at offset 0)"),
        (
            "seed: 0\n# caf\xe9 (latin-1)\n".encode("latin-1"),
            "is not UTF-8 text (byte 0xe9 at offset 13)",
        ),
        (b"seed: 0\x00\x01\x02\n", "is not valid YAML"),
        (b"seed: [1, 2\n", "is not valid YAML"),
        (b"when: 2024-13-01\n", "is not valid YAML"),
        (b"- 1\n- 2\n", "must hold a mapping at the top level"),
    ],
)
def test_config_files_that_are_not_utf8_yaml_mappings(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(f"config file {path} {message}")):
        load(RunConfig, path)


def test_config_path_that_is_a_directory_or_too_long(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load(RunConfig, tmp_path)
    with pytest.raises(ConfigError, match="config file path is 5005 bytes long"):
        load(RunConfig, "/" + "c" * 5000 + ".yml")


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"d_model": 48, "n_heads": 3, "n_layers": 3, "mlp_ratio": 2},
        {"tie_embeddings": False, "vocab_size": 300},
        {"d_model": 64, "n_heads": 2, "n_layers": 1, "mlp_ratio": 1, "tie_embeddings": False},
    ],
)
def test_param_count_matches_the_built_model(shape):
    from flax import nnx

    from tpulab.model.config import PrecisionConfig, param_count
    from tpulab.model.transformer import Transformer, built_param_count

    cfg = dataclasses.replace(tiny_config().model, **shape)
    model = nnx.eval_shape(
        lambda: Transformer(cfg, PrecisionConfig(), rngs=nnx.Rngs(params=0))
    )  # shapes only
    assert param_count(cfg) == built_param_count(model)
    assert param_count(dataclasses.replace(cfg, n_layers=cfg.n_layers + 1)) > param_count(
        cfg
    )  # shapes matter


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_state_bytes_matches_the_real_state(dtype):
    """Params + gradients (param-shaped) + optimizer float leaves, from the real abstract state."""
    import jax
    import numpy as np

    from tpulab.model.config import train_state_bytes
    from tpulab.train.step import make_steps

    cfg = tiny_config(f"precision.param_dtype={dtype}", f"precision.compute_dtype={dtype}")
    state = make_steps(cfg).abstract_state()

    def nbytes(tree):
        return sum(
            x.size * x.dtype.itemsize
            for x in jax.tree.leaves(tree)
            if np.issubdtype(x.dtype, np.floating) or x.dtype == jax.numpy.bfloat16
        )

    real = 2 * nbytes(state.params) + nbytes(state.opt_state)
    assert train_state_bytes(cfg.model, cfg.precision) == real


def test_check_fits_host():
    from tpulab.model.config import train_state_bytes
    from tpulab.train.memory import available_host_bytes, check_fits_host

    cfg = tiny_config()
    need = train_state_bytes(cfg.model, cfg.precision)
    assert check_fits_host(cfg, available=need) == need
    with pytest.raises(
        ConfigError, match="cannot fit in memory: .* parameters need at least .* GiB"
    ):
        check_fits_host(cfg, available=need - 1)
    total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    assert 0 < available_host_bytes() <= total
    big = tiny_config(
        "model.d_model=65536", "model.n_layers=4096"
    )  # ~2.3e14 parameters: no host has 3 PiB
    with pytest.raises(ConfigError, match="cannot fit in memory"):
        check_fits_host(big)
