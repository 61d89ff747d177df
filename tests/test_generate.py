"""Generation: one validation place, the on-device sampler, the step path and the compiled loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpulab.errors import TpulabError
from tpulab.model.sampling import SamplingConfig, key_data, prompt_ids, sample_tokens


@pytest.fixture(scope="module")
def fns(trained_run):
    from tpulab.model.decode import ModelFns
    from tpulab.train.restore import load_model

    return ModelFns(load_model(trained_run).model)


def _sample(logits, keys, step=0, temperature=1.0, top_k=0):
    b = keys.shape[0]
    return np.asarray(
        jax.jit(sample_tokens)(
            jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (b, len(logits))),
            jnp.asarray(keys),
            jnp.int32(step),
            jnp.full((b,), temperature, jnp.float32),
            jnp.full((b,), top_k, jnp.int32),
        )
    )


def _keys(n, seed0=0):
    return np.stack([key_data(seed0 + i) for i in range(n)])


def test_a_row_samples_the_same_whatever_its_neighbours_ask_for():
    """The sampler skips the draw when no row samples and the top-k sort when no sampling row asks
    for it; each row's token must not depend on which branch its batch took (rows alone vs mixed
    together)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 256)) * 3, jnp.float32)
    keys = jnp.asarray(_keys(6, 100))
    temps = jnp.asarray([0.0, 1.0, 0.0, 2.0, 0.7, 0.0], jnp.float32)
    top_k = jnp.asarray(
        [0, 5, 3, 0, 1, 0], jnp.int32
    )  # row 2: a top_k with temperature 0 is still greedy
    f = jax.jit(sample_tokens)
    together = np.asarray(f(logits, keys, jnp.int32(4), temps, top_k))
    alone = [
        int(
            f(logits[i : i + 1], keys[i : i + 1], jnp.int32(4), temps[i : i + 1], top_k[i : i + 1])[
                0
            ]
        )
        for i in range(6)
    ]
    assert together.tolist() == alone
    assert together[0] == int(jnp.argmax(logits[0])) and together[4] == int(
        jnp.argmax(logits[4])
    )  # top_k 1


def test_sampler_greedy_top_k_and_distribution():
    logits = np.array([0.1, 3.0, 2.9, -1.0, 1.5])
    keys = _keys(4000)
    assert set(_sample(logits, keys[:50], temperature=0.0)) == {1}
    assert set(_sample(logits, keys[:200], top_k=1)) == {1}
    assert set(_sample(logits, keys, temperature=5.0, top_k=2)) == {1, 2}
    # The same distribution as softmax(logits / t): total variation over 4000 draws (sd ~0.01).
    for t in (1.0, 0.5):
        draws = _sample(logits, keys, temperature=t)
        p = np.exp(logits / t - np.max(logits / t))
        p /= p.sum()
        freq = np.bincount(draws, minlength=len(logits)) / len(draws)
        assert 0.5 * np.abs(freq - p).sum() < 0.03, (freq, p)
    # Negative control: a temperature that is not the one asked for is visibly off.
    draws = _sample(logits, keys, temperature=3.0)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    assert 0.5 * np.abs(np.bincount(draws, minlength=len(logits)) / len(draws) - p).sum() > 0.1


def test_sampler_key_and_step_decide_the_draw():
    logits = np.zeros(258)
    keys = _keys(8)
    a, b = _sample(logits, keys, step=3), _sample(logits, keys, step=3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, _sample(logits, keys, step=4))
    assert not np.array_equal(a, _sample(logits, _keys(8, seed0=100), step=3))
    assert key_data(2**63 - 1).tolist() == [0x7FFFFFFF, 0xFFFFFFFF]


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"max_new": 0}, "max_new"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 5e-324}, "temperature"),
        ({"temperature": 1e-4}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 11.0}, "temperature"),
        ({"top_k": 999}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"max_new": 1.5}, "max_new"),
        ({"temperature": True}, "temperature"),
    ],
)
def test_sampling_config_rejects_bad_values(bad, field):
    with pytest.raises(TpulabError, match=field):
        SamplingConfig(**bad)


def test_sampling_config_accepts_its_bounds():
    for t in (0.0, 1e-3, 10.0):
        assert SamplingConfig(temperature=t).temperature == t


@pytest.mark.parametrize(
    "prompt, reason",
    [
        ("", "empty"),
        ("\udcff", "not valid UTF-8"),
        ("ok\ud800", "not valid UTF-8"),
        ("x" * 5000, "at most 4096"),
        ("x" * 30, "exceeds the model's 32 positions"),
        (b"bytes", "must be a string"),
    ],
)
def test_prompt_validation(prompt, reason):
    with pytest.raises(TpulabError, match=reason):
        prompt_ids(prompt, 32, 4)


def test_compiled_loop_equals_step_path_bitwise(fns):
    """Greedy and seeded sampling, every cache policy: the one-dispatch loop gives the step path's
    tokens."""
    from tpulab.inference.generate import Request, generate_batch, generate_ids
    from tpulab.model.decode import Decoder

    cfgs = (
        SamplingConfig(max_new=10, temperature=0.0),
        SamplingConfig(max_new=10, temperature=1.3, top_k=40, seed=9),
    )
    for policy in ("fp32", "bf16", "int8"):
        dec = Decoder(fns, policy)
        for cfg in cfgs:
            for prompt in ("To be", "KING RICHARD:"):
                step = list(generate_ids(dec, prompt, cfg))
                loop = generate_batch(dec, [Request.of(prompt, cfg, dec.max_len)])[0]
                assert loop == step, (policy, cfg, prompt)
    # Negative control: another seed gives other sampled tokens.
    dec = Decoder(fns, "fp32")
    other = SamplingConfig(max_new=10, temperature=1.3, top_k=40, seed=10)
    assert generate_batch(dec, [Request.of("To be", other, 32)])[0] != list(
        generate_ids(dec, "To be", cfgs[1])
    )


def test_ragged_batch_rows_equal_each_prompt_alone(fns):
    """Prompts of different lengths and per-row max_new/sampling decoded together = each decoded
    alone."""
    from tpulab.inference.generate import Request, batch_arrays, generate_batch
    from tpulab.model.decode import Decoder

    dec = Decoder(fns, "fp32")
    reqs = [
        Request.of("a", SamplingConfig(max_new=7, temperature=0.0), 32),
        Request.of("ROMEO: But soft", SamplingConfig(max_new=12, temperature=0.0), 32),
        Request.of("To be, or", SamplingConfig(max_new=3, temperature=0.9, seed=4), 32),
    ]
    together = generate_batch(dec, reqs)
    assert [len(t) for t in together] == [7, 12, 3]
    assert together == [generate_batch(dec, [r])[0] for r in reqs]
    # The prefill logits of each row, ragged batch vs alone: fp32, bitwise on CPU (tolerance 1e-5
    # stated).
    tokens, lengths = batch_arrays(reqs, 32, 4)[:2]
    batch_logits = np.asarray(
        jax.jit(fns.prefill_rows, static_argnums=0)("fp32", fns.params, tokens, lengths)[0]
    )
    for b in range(len(reqs)):
        alone = np.asarray(dec.prefill(tokens[b : b + 1], lengths[b])[0])[0]
        np.testing.assert_allclose(batch_logits[b], alone, rtol=0, atol=1e-5)
    # Negative control: a row given another row's length computes something else.
    assert not np.allclose(
        batch_logits[1], np.asarray(dec.prefill(tokens[1:2], lengths[2])[0])[0], atol=1e-3
    )


def test_stop_token_ends_a_row_and_no_recompile_within_a_bucket(fns):
    from tpulab.inference.generate import Request, generate_batch
    from tpulab.model.decode import Decoder

    dec = Decoder(fns, "fp32")
    cfg = SamplingConfig(max_new=12, temperature=0.0)
    full = generate_batch(dec, [Request.of("To be", cfg, 32)])[0]
    stop = full[3]
    first = full.index(stop)
    cut = generate_batch(dec, [Request.of("To be", cfg, 32)], stop_token=stop)[0]
    assert cut == full[: first + 1]
    before = dec.compiled_variants()["generate"]
    for prompt, n in (
        ("a", 1),
        ("KING:", 5),
        ("ROMEO: But soft", 9),
        ("xy", 3),
    ):  # batch 1, width 16
        generate_batch(dec, [Request.of(prompt, SamplingConfig(max_new=n, temperature=0.5), 32)])
    assert dec.compiled_variants()["generate"] == before
    for k in (3, 4):  # batch bucket 4, width 16
        generate_batch(dec, [Request.of("ab" * k, cfg, 32)] * k)
    assert dec.compiled_variants()["generate"] == before + 1
    for prompt in (
        "ROMEO: But soft, what",
        "KING RICHARD III:",
    ):  # width bucket 32 (prompt + BOS > 16)
        generate_batch(dec, [Request.of(prompt, SamplingConfig(max_new=4), 32)])
    assert dec.compiled_variants()["generate"] == before + 2


def test_same_seed_same_text_and_prompt_bound(fns):
    from tpulab.inference.generate import generate_text
    from tpulab.model.decode import Decoder

    dec = Decoder(fns, "bf16")
    cfg = SamplingConfig(max_new=16, temperature=1.0, top_k=50, seed=3)
    first = "".join(generate_text(dec, "KING:", cfg))
    assert first == "".join(generate_text(dec, "KING:", cfg))
    with pytest.raises(TpulabError, match="exceeds the model's 32 positions"):
        list(generate_text(dec, "x" * 30, SamplingConfig(max_new=4)))
    assert dec.compiled_variants()["prefill"] == 1 and dec.compiled_variants()["decode"] == 1


@pytest.mark.parametrize(
    "args, reason",
    [
        (("--temperature", "5e-324"), "temperature="),
        (("--temperature", "nan"), "temperature=nan"),
        (("--temperature", "inf"), "temperature=inf"),
        (("--prompt", "\udcff\udcfe"), "not valid UTF-8"),
        (("--prompt", ""), "prompt is empty"),
        (("--max-new", "0"), "max_new=0"),
        (("--seed", str(2**64)), "seed="),
    ],
)
def test_generate_cli_bad_input_is_one_line(trained_run, capsys, args, reason):
    from tpulab.cli.main import main

    argv = ["generate", "--run-dir", str(trained_run), "--prompt", "ab", "--max-new", "4", *args]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert (
        rc != 0
        and out == ""
        and err.count("\n") == 1
        and err.startswith("error: ")
        and reason in err
    ), err


@pytest.mark.slow
def test_generate_cli_streams_deterministically(trained_run, capsys):
    """The same seeded command gives the same stream in a fresh process as in this one (``main``:
    run first, so the child loads its compiles from the shared cache); a prompt too long for the
    model is one line; a prompt that is not UTF-8 on a real command line (bytes argv) too."""
    import subprocess
    import sys

    from conftest import REPO, run_cli
    from tpulab.cli.main import main

    args = (
        "generate",
        "--run-dir",
        str(trained_run),
        "--prompt",
        "ROMEO:",
        "--max-new",
        "12",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--seed",
        "5",
        "--cache",
        "int8",
    )
    assert main(list(args)) == 0
    here = capsys.readouterr().out
    a = run_cli(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == here and a.stdout.startswith("ROMEO:")
    rc = main(["generate", "--run-dir", str(trained_run), "--prompt", "x" * 40])
    err = capsys.readouterr().err
    assert rc != 0 and err.strip().startswith("error: prompt (40 bytes") and err.count("\n") == 1
    # A prompt that is not UTF-8 on the real command line (bytes argv).
    raw = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpulab.cli",
            "generate",
            "--run-dir",
            str(trained_run),
            "--prompt",
            b"\xff\xfeab",
        ],
        capture_output=True,
        cwd=REPO,
        timeout=300,
    )
    err = raw.stderr.decode()
    assert (
        raw.returncode != 0 and err.count("\n") == 1 and "not valid UTF-8" in err and not raw.stdout
    ), err


def _while_body_cache_work(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """Instructions of the largest while body (the decode loop) that produce a whole cache-layer
    buffer, other than the in-place update itself: copies, transposes or fusions that rewrite a
    layer every step."""
    import re

    bodies, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^%?([\w.\-]+) .*\{$", line)
        if m:
            name, bodies[m.group(1)] = m.group(1), []
        elif name and line.startswith("  "):
            bodies[name].append(line.strip())
    loop = max(re.findall(r"body=%?([\w.\-]+)", hlo), key=lambda b: len(bodies.get(b, [])))
    found = []
    for ins in bodies[loop]:
        m = re.match(r"(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]\S* ([\w\-]+)\(", ins)
        if not m or tuple(int(d) for d in m.group(2).split(",") if d) not in shapes:
            continue
        iname, op = m.group(1), m.group(3)
        in_place = op in ("dynamic-update-slice", "scatter") or (
            op == "fusion" and ("dynamic-update-slice" in iname or "scatter" in iname)
        )
        if not in_place and op not in ("get-tuple-element", "parameter", "bitcast", "tuple"):
            found.append(f"{iname} ({op})")
    return found


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_loop_never_copies_a_cache_layer(fns, batch):
    """The compiled loop's body updates each layer's keys and values in place and reads them where
    they lie: no instruction rewrites a whole cache-layer buffer per step (the exported layout cost
    33 such copies per step at batch 1). Negative control: a loop that rolls its buffer every step
    is flagged by the same check."""
    from tpulab.model import kvcache as kv
    from tpulab.model.decode import Decoder

    dec = Decoder(fns, "fp32")
    tokens = np.full((batch, 16), 5, np.int32)
    args = (
        tokens,
        np.full((batch,), 4, np.int32),
        np.full((batch,), 8, np.int32),
        np.zeros((batch,), np.float32),
        np.zeros((batch,), np.int32),
        np.zeros((batch, 2), np.uint32),
        np.int32(-1),
    )
    hlo = dec._generate.lower(dec.params, *args).compile().as_text()
    loop_cache = jax.eval_shape(lambda: kv.to_loop_layout(fns.shape.init("fp32", batch)))
    shapes = {tuple(x.shape) for x in jax.tree.leaves(loop_cache)}
    assert _while_body_cache_work(hlo, shapes) == []

    def rolling(buf):
        def body(c):
            i, b = c
            return i + 1, jnp.roll(b, 1, axis=1).at[:, 0].set(jnp.float32(i))

        return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, buf))[1]

    buf = jnp.zeros(next(iter(shapes)), jnp.float32)
    assert _while_body_cache_work(jax.jit(rolling).lower(buf).compile().as_text(), shapes) != []


def test_prompt_width_buckets_cover_every_length_with_few_shapes():
    """Every prompt length gets a width that holds it, never past the cache; powers of two up to
    128, then steps of 64 (a 448-token prompt is not padded to 512); a handful of distinct widths,
    so compiles stay few."""
    from tpulab.model.decode import width_bucket

    for max_len in (128, 512, 1024):
        widths = [width_bucket(n, max_len) for n in range(1, max_len + 1)]
        assert all(n <= w <= max_len for n, w in zip(range(1, max_len + 1), widths))
        assert widths == sorted(widths)
        assert len(set(widths)) <= 4 + (max_len - 128) // 64
    assert [width_bucket(n, 512) for n in (1, 17, 100, 129, 448, 449)] == [
        16,
        32,
        128,
        192,
        448,
        512,
    ]
