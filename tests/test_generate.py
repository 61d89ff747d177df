"""Generation: sampling rules, seeded determinism, prompt bounds, the CLI."""

from __future__ import annotations

import numpy as np
import pytest

from tpulab.errors import TpulabError
from tpulab.inference.generate import SamplingConfig, sample


def test_sampling_greedy_and_top_k():
    logits = np.array([0.1, 3.0, 2.9, -1.0])
    rng = np.random.default_rng(0)
    assert sample(logits, rng, 0.0, 0) == 1
    assert all(sample(logits, rng, 1.0, 1) == 1 for _ in range(20))
    assert {sample(logits, rng, 5.0, 2) for _ in range(200)} == {1, 2}


@pytest.mark.parametrize("bad", [{"max_new": 0}, {"temperature": -0.1}, {"top_k": 999}, {"seed": -1}])
def test_sampling_config_rejects_bad_values(bad):
    with pytest.raises(TpulabError, match=next(iter(bad))):
        SamplingConfig(**bad)


def test_same_seed_same_text_and_prompt_bound(trained_run):
    from tpulab.inference.decode import Decoder
    from tpulab.inference.generate import generate_text
    from tpulab.train.restore import load_model

    dec = Decoder.of(load_model(trained_run).model, "bf16")
    cfg = SamplingConfig(max_new=16, temperature=1.0, top_k=50, seed=3)
    first = "".join(generate_text(dec, "KING:", cfg))
    assert first == "".join(generate_text(dec, "KING:", cfg))
    assert len(first.encode("utf-8", errors="surrogatepass")) > 0
    with pytest.raises(TpulabError, match="exceeds the model's 32 positions"):
        list(generate_text(dec, "x" * 30, SamplingConfig(max_new=4)))
    assert dec.compiled_variants() == {"prefill": 1, "decode": 1}


@pytest.mark.slow
def test_generate_cli_streams_deterministically(trained_run):
    from conftest import run_cli

    args = ("generate", "--run-dir", str(trained_run), "--prompt", "ROMEO:", "--max-new", "12",
            "--temperature", "0.8", "--top-k", "20", "--seed", "5", "--cache", "int8")
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("ROMEO:")
    bad = run_cli("generate", "--run-dir", str(trained_run), "--prompt", "x" * 40)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("error: prompt (40 bytes")
