"""`tpulab convert`: a trained byte Transformer to its PyTorch twin and back, each conversion
checked layer by layer.

``to_torch_file``: the run's newest verified checkpoint (its plain model: a LoRA run's adapters
merged, a PPO policy without its value head) through the table (``bridge.convert_table``) into the
twin (``bridge.twin``), written as a self-describing torch file. ``from_torch_file``: such a file
back into a run dir holding one model-only checkpoint, which ``load_model`` reads and verifies as
it reads any run's (``train.merge.write_model_run``, merge-lora's writer). Either way, before
anything is written, both models run one fixed batch of held-out bytes with forward hooks on every
layer (``bridge.layers``): a layer over its fp32 bound fails the command and is named; then greedy
generations from held-out prompts, tpulab's compiled generation against the twin's, must be equal.
The check localises a conversion error (a table entry, the norm epsilon, a tied head); it cannot
see weights that are wrong on both sides alike, which is what the sha256 sums and the verified
checkpoint are for.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpulab.bridge import layers
from tpulab.bridge.convert_table import (
    TABLE,
    Entry,
    from_torch,
    load_twin,
    read_torch_file,
    to_torch,
    torch_file_bytes,
)
from tpulab.bridge.twin import TorchTransformer, greedy, torch_threads
from tpulab.checkpoint.files import atomic_write_bytes, check_out, sha256_bytes, sha256_file
from tpulab.config import from_dict, to_dict
from tpulab.errors import ConfigError, TpulabError
from tpulab.inference.cache_eval import heldout_windows
from tpulab.model.transformer import NORM_EPS
from tpulab.train.config import ObjectiveConfig, RunConfig
from tpulab.train.merge import write_model_run
from tpulab.train.restore import load_model
from tpulab.train.step import TrainState, merge_model, transformer_graph

CHECK_WINDOWS = 8  # held-out windows in the per-layer batch (every 4th of 32 evenly spaced)
GREEDY_PROMPTS = 4  # held-out prompts generated from (of the 32), max_seq_len // 2 bytes each


def plain_config(config: RunConfig) -> RunConfig:
    """The run config of the plain model a run computes with, as a converted model's run records
    it (pretraining's objective: no adapters, no frozen models); refuses what the twin cannot be."""
    if config.model.family != "transformer":
        raise TpulabError(
            f"tpulab convert handles the byte Transformer; model.family={config.model.family}"
        )
    p = config.precision
    if (p.param_dtype, p.compute_dtype) != ("float32", "float32"):
        raise TpulabError(
            f"tpulab convert handles float32 models; this one has precision.param_dtype="
            f"{p.param_dtype}, compute_dtype={p.compute_dtype}"
        )
    return dataclasses.replace(config, objective=ObjectiveConfig())


def flat_params(state: nnx.State) -> dict[str, np.ndarray]:
    """``nnx.State`` -> {dotted path: host array} (``blocks.0.attn.qkv.kernel``)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
        out[name] = np.asarray(x)
    return out


def _template(config: RunConfig) -> tuple[list[str], list, object]:
    """Parameter names, shapes and structure of the run's Transformer, built without remat: the
    same parameters and forward, and each block called as itself, so its hooks see it (under
    ``nnx.remat`` a block runs as a copy)."""
    plain = dataclasses.replace(config.model, remat="none")
    graphdef, init = transformer_graph(dataclasses.replace(config, model=plain))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(jax.eval_shape(init))
    names = [
        jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value")
        for p, _ in leaves
    ]
    return names, [x for _, x in leaves], (graphdef, treedef)


def flax_model(config: RunConfig, flat: dict[str, np.ndarray]) -> tuple[nnx.Module, nnx.State]:
    """The tpulab Transformer of ``config`` holding ``flat`` (every name its own, bitwise)."""
    names, _, (graphdef, treedef) = _template(config)
    params = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(flat[n]) for n in names])
    return merge_model(graphdef, params), params


def greedy_prompts(cfg, windows: np.ndarray) -> tuple[np.ndarray, int]:
    """Up to GREEDY_PROMPTS held-out prompts of max_seq_len // 2 bytes (no padding), and how many
    tokens to generate from each: max_seq_len // 4."""
    from tpulab.data.tokenizer import PAD

    p = cfg.max_seq_len // 2
    rows = [w[:p] for w in windows if (w[:p] != PAD).all()][:GREEDY_PROMPTS]
    if not rows:
        raise TpulabError(f"no held-out window has {p} bytes for a greedy prompt")
    return np.stack(rows).astype(np.int32), cfg.max_seq_len // 4


def tpulab_greedy(model: nnx.Module, prompts: np.ndarray, new: int) -> list[list[int]]:
    """tpulab's greedy generation: its KV-cache path (the jitted prefill and decode step that
    streaming runs, ``model.decode.Decoder``). Not the one-dispatch compiled loop: at the default
    size its compile alone took 9.3 s at load 5.5 on 2 cores, prefill + decode 5.2 s."""
    from tpulab.model.decode import Decoder, pad_prompt

    n, p = model.cfg.max_seq_len, prompts.shape[1]
    engine = Decoder.of(model, "fp32")
    logits_bv, cache = engine.prefill(np.concatenate([pad_prompt(r, n) for r in prompts]), p)
    steps = []
    for i in range(new):
        token_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        steps.append(np.asarray(token_b))
        if i + 1 < new:
            logits_bv, cache = engine.decode(cache, token_b, np.int32(p + i))
    return np.stack(steps, axis=1).tolist()


def compare_generations(ours: list, twin: TorchTransformer, prompts: np.ndarray, new: int) -> dict:
    """tpulab's greedy tokens against the twin's from the same prompts, token for token."""
    with torch_threads(1):
        theirs = greedy(twin, prompts, new).tolist()
    first = next(
        ((i, j) for i, (a, b) in enumerate(zip(ours, theirs)) for j in range(new) if a[j] != b[j]),
        None,
    )
    return {
        "prompts": len(prompts),
        "prompt_len": prompts.shape[1],
        "new_tokens": new,
        "equal": first is None,
        "first_difference": None if first is None else {"prompt": first[0], "token": first[1]},
    }


def greedy_pair(model: nnx.Module, twin: TorchTransformer, windows: np.ndarray) -> dict:
    """Greedy generations from held-out prompts, tpulab's and the twin's, compared."""
    prompts, new = greedy_prompts(model.cfg, windows)
    return compare_generations(tpulab_greedy(model, prompts, new), twin, prompts, new)


def check_conversion(
    model: nnx.Module,
    twin: TorchTransformer,
    config: RunConfig,
    source: str,
    bounds: layers.Bounds = layers.BOUNDS,
) -> dict:
    """The per-layer table of the converted side against ``source`` ("tpulab" or "torch") over
    the held-out batch, and the greedy comparison when every bound holds. tpulab's generations
    run in a second thread meanwhile: its two compiles overlap the table's (on 2 idle cores the
    command's wall time drops by about their length). The hooks patch module classes while the
    table's forward is traced; the generation's modules are other instances, never recorded."""
    held = heldout_windows(config, 4 * CHECK_WINDOWS)  # evenly spaced over the held-out documents
    windows = held[::4, :-1]  # the fixed batch
    prompts, new = greedy_prompts(config.model, held)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        generated = pool.submit(tpulab_greedy, model, prompts, new)
        ours = layers.flax_outputs(model, windows)
        with torch_threads(1):
            theirs = layers.torch_outputs(twin, windows)
        src, dst = (ours, theirs) if source == "tpulab" else (theirs, ours)
        result = layers.compare(src, dst, bounds)
        result["source"] = source
        result["batch"] = {"shape": list(windows.shape), "sha256": sha256_bytes(windows.tobytes())}
        if result["passed"]:
            result["greedy"] = compare_generations(generated.result(), twin, prompts, new)
            result["passed"] = result["greedy"]["equal"]
    return result


def _refuse(result: dict) -> None:
    if result["first_failure"] is not None:
        raise TpulabError(
            f"conversion check failed; {layers.failure_line(result)}; nothing written"
        )
    if not result["passed"]:
        d = result["greedy"]["first_difference"]
        raise TpulabError(
            f"conversion check failed: greedy generations differ (prompt {d['prompt']}, new "
            f"token {d['token']}); nothing written"
        )


@dataclasses.dataclass(frozen=True)
class How:
    """The table a conversion reads and the bounds its check holds it to (the defaults: the one
    table and the stated fp32 bounds; a test passes a broken table as a negative control)."""

    table: tuple[Entry, ...] = TABLE
    bounds: layers.Bounds = layers.BOUNDS


def to_torch_file(run_dir: str | Path, out: str | Path, how: How = How()) -> dict:
    """The run's newest verified model as a torch file at ``out``; returns the conversion record."""
    t0 = time.perf_counter()
    out = check_out(out, file=True)
    restored = load_model(run_dir)
    config = plain_config(restored.config)
    flat = flat_params(restored.plain_params())
    model, _ = flax_model(config, flat)
    sd = to_torch(flat, config.model, how.table)
    twin = load_twin(sd, config.model, NORM_EPS, "the converted state dict")
    result = check_conversion(model, twin, config, "tpulab", how.bounds)
    _refuse(result)
    source = {
        "run_dir": str(run_dir),
        "step": restored.step,
        "checkpoint_digest": restored.checkpoint_digest,
    }
    header = {
        "norm_eps": NORM_EPS,
        "run_config": to_dict(config),
        "source": source,
        "check": result,
    }
    atomic_write_bytes(out, torch_file_bytes(sd, config.model, header))
    return {**result, "out": str(out), "source_info": source, "seconds": time.perf_counter() - t0}


def from_torch_file(path: str | Path, out: str | Path, how: How = How()) -> dict:
    """A torch file back as a run dir ``out`` holding one model-only checkpoint."""
    t0 = time.perf_counter()
    out = check_out(out)
    f = read_torch_file(Path(path))
    try:
        config = from_dict(RunConfig, f.header.get("run_config"))
    except (ConfigError, TypeError) as e:
        raise TpulabError(f"torch file {path}: its run_config is refused: {e}") from None
    if to_dict(config.model) != to_dict(f.model):
        raise TpulabError(f"torch file {path}: its run_config's model is not its model_config")
    config = plain_config(config)
    twin = load_twin(f.state_dict, f.model, f.norm_eps, f"torch file {path}")
    names, shapes, _ = _template(config)
    flat = from_torch(
        f.state_dict,
        config.model,
        dict(zip(names, (s.shape for s in shapes))),
        how.table,
        f"torch file {path}",
    )
    model, params = flax_model(config, flat)
    result = check_conversion(model, twin, config, "torch", how.bounds)
    _refuse(result)
    step = int(f.header.get("source", {}).get("step", 0))
    state = TrainState(jnp.asarray(step, jnp.int32), params, (), jax.random.PRNGKey(config.seed))
    meta = {"identities": {"converted_from": sha256_file(path)}, "conversion": result}
    digest = write_model_run(out, config, step, state, meta)
    return {
        **result,
        "out": str(out),
        "checkpoint_digest": digest,
        "step": step,
        "seconds": time.perf_counter() - t0,
    }
