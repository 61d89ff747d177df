"""Decode speed: the compiled loop, the step-by-step cached loop, and recomputing the full forward.

Three greedy paths, side by side in one process, each timed end to end (prefill included) after a
warm-up that compiles every shape it uses, best of ``repeats``:

- **compiled loop**: prefill + ``lax.while_loop`` with on-device sampling, one dispatch for all
  tokens (``ModelFns.generate``; what the service runs);
- **step loop**: prefill, then one jitted decode dispatch per token from a Python loop, the token
  kept on device (no host sync per token): the path generation used before the compiled loop;
- **recompute**: no cache; the full forward over the prefix padded up to a multiple of ``bucket``
  tokens for every new token (a handful of compiles, cost growing with the context).

``batch_table`` measures the compiled loop's tokens/s against batch size for each cache precision,
with what bounds each decode step: its arithmetic (achieved GFLOP/s) and the bytes it must read
(every weight and the whole cache, once), next to the least time this host takes to read that many
bytes.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.data.tokenizer import PAD
from tpulab.evidence.report_kit import table
from tpulab.model import kvcache as kv
from tpulab.model.config import matmul_params
from tpulab.model.decode import Decoder, ModelFns

if TYPE_CHECKING:
    from tpulab.train.restore import Restored


def _greedy_next(fns: ModelFns, params, tokens_bt, pos):
    """No cache: the full forward over the (padded) prefix, argmax at position ``pos - 1``, written
    at ``pos``."""
    logits_btv = fns.full_logits(params, tokens_bt)
    nxt = jnp.argmax(
        jax.lax.dynamic_index_in_dim(logits_btv, pos - 1, axis=1, keepdims=False), axis=-1
    )
    return jax.lax.dynamic_update_slice(tokens_bt, nxt[:, None].astype(jnp.int32), (0, pos))


def _cached_step(fns: ModelFns, params, cache, token_b, pos):
    logits_bv, cache = fns.decode(params, cache, token_b, pos)
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32), cache


def measure(
    fns: ModelFns,
    prompt_len: int,
    new_tokens: int,
    *,
    policy: str = "fp32",
    bucket: int = 32,
    repeats: int = 3,
) -> dict:
    """Best-of-``repeats`` tokens/s for both paths on one prompt of ``prompt_len`` tokens (batch
    1)."""
    s = fns.shape.max_len
    if prompt_len + new_tokens > s:
        raise ValueError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds {s}")
    prompt = (np.arange(prompt_len, dtype=np.int32) * 7 % 256)[None]
    dec = Decoder(fns, policy)
    step = jax.jit(functools.partial(_cached_step, fns), donate_argnums=(1,))
    nocache = jax.jit(functools.partial(_greedy_next, fns))

    def run_cached():
        tokens = np.full((1, s), PAD, np.int32)
        tokens[:, :prompt_len] = prompt
        logits, cache = dec.prefill(tokens, prompt_len)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out = [tok]
        for i in range(new_tokens - 1):
            tok, cache = step(dec.params, cache, tok, jnp.int32(prompt_len + i))
            out.append(tok)
        return jnp.stack(out, 1)

    def run_nocache():
        width = lambda n: min(s, -(-n // bucket) * bucket)  # noqa: E731
        buf = jnp.asarray(np.pad(prompt, ((0, 0), (0, s - prompt_len)), constant_values=PAD))
        for i in range(new_tokens):
            pos = prompt_len + i
            w = width(pos + 1)
            buf = buf.at[:, :w].set(nocache(fns.params, buf[:, :w], jnp.int32(pos)))
        return buf[:, prompt_len : prompt_len + new_tokens]

    width = dec.width_for(prompt_len)
    loop_args = (
        np.pad(prompt, ((0, 0), (0, width - prompt_len)), constant_values=PAD),
        np.array([prompt_len], np.int32),
        np.array([new_tokens], np.int32),
        np.zeros((1,), np.float32),
        np.zeros((1,), np.int32),
        np.zeros((1, 2), np.uint32),
        np.int32(-1),
    )

    def run_loop():
        return dec.generate(*loop_args)[0][:, :new_tokens]

    # Interleaved repeats (loop, step, recompute, loop, ...), best of each: on a shared machine a
    # burst of load then hits all three paths alike instead of whichever happened to run during it.
    fns_ = (run_loop, run_cached, run_nocache)
    outs = [
        np.asarray(jax.block_until_ready(fn())) for fn in fns_
    ]  # warm-up: compiles every shape used
    times = [[], [], []]
    for _ in range(repeats):
        for k, fn in enumerate(fns_):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    (t_loop, t_cached, t_full), (out_l, out_c, out_f) = [min(t) for t in times], outs
    return {
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "cache": policy,
        "batch": 1,
        "loop_tokens_per_s": new_tokens / t_loop,
        "cached_tokens_per_s": new_tokens / t_cached,
        "recompute_tokens_per_s": new_tokens / t_full,
        "loop_vs_step": t_cached / t_loop,
        "loop_vs_recompute": t_full / t_loop,
        "speedup": t_full / t_cached,
        "same_tokens": bool(np.array_equal(out_c, out_f) and np.array_equal(out_l, out_c)),
    }


def decode_speed(
    source: Restored,
    prompt_lens: tuple[int, ...] | None = None,
    new_tokens: int | None = None,
    **kw,
) -> list[dict]:
    """Rows for two prompt lengths (default: 1/8 and 1/2 of the cache length, 1/4 of it new
    tokens)."""
    fns = ModelFns(source.model)
    s = fns.shape.max_len
    prompt_lens = prompt_lens or (max(1, s // 8), s // 2)
    new_tokens = new_tokens or max(1, s // 4)
    return [measure(fns, p, new_tokens, **kw) for p in prompt_lens]


def speed_table(rows: list[dict]) -> str:
    headers = ["prompt tokens", "new tokens", "compiled loop tok/s", "step loop tok/s"]
    headers += ["recompute tok/s", "loop vs step", "loop vs recompute", "step vs recompute"]
    return table(
        [*headers, "same tokens"],
        [
            (
                r["prompt_len"],
                r["new_tokens"],
                f"{r['loop_tokens_per_s']:.0f}",
                f"{r['cached_tokens_per_s']:.0f}",
                f"{r['recompute_tokens_per_s']:.0f}",
                f"{r['loop_vs_step']:.1f}x",
                f"{r['loop_vs_recompute']:.1f}x",
                f"{r['speedup']:.1f}x",
                r["same_tokens"],
            )
            for r in rows
        ],
    )


def read_seconds(nbytes: float, repeats: int = 50) -> float:
    """The least time one jitted XLA reduction takes to read ``nbytes`` of fp32 once (best of
    ``repeats``, one dispatch included): a floor for any program that must read that many bytes, as
    a batch-1 decode step reads every weight and its whole cache."""
    x = jnp.ones((max(1, int(nbytes) // 512), 128), jnp.float32)
    total = jax.jit(lambda a: jnp.sum(a, axis=0))
    jax.block_until_ready(total(x))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(total(x))
        best = min(best, time.perf_counter() - t0)
    return best


def step_work(fns: ModelFns, policy: str, batch: int) -> dict:
    """What one compiled-loop decode step of ``batch`` rows must do: FLOPs (2 per matmul parameter
    per row, plus the two attention products over all S cache slots, which the loop computes masked
    or not) and bytes read (every weight, and every layer's keys and values for all rows, in the
    cache's storage)."""
    cfg, s = fns.cfg, fns.shape.max_len
    flops = batch * (2 * matmul_params(cfg) + 4 * cfg.n_layers * s * cfg.d_model)
    weights = sum(x.nbytes for x in fns.params.values())
    return {
        "flops_per_step": float(flops),
        "bytes_per_step": float(weights + fns.shape.nbytes(policy, batch)),
    }


def measure_batch(
    fns: ModelFns, policy: str, batch: int, prompt_len: int, new_tokens: int, repeats: int = 3
) -> dict:
    """Compiled-loop decode tokens/s for ``batch`` greedy rows: the time of a run with
    ``new_tokens`` new tokens minus that of a run with 1 (prefill and dispatch cancel), over ``batch
    * (new_tokens - 1)``."""
    dec = Decoder(fns, policy)
    width = dec.width_for(prompt_len)
    tokens = np.full((batch, width), PAD, np.int32)
    tokens[:, :prompt_len] = (np.arange(prompt_len, dtype=np.int32) * 7 % 256)[None] + np.arange(
        batch
    )[:, None] % 3

    def args(n):
        return (
            tokens,
            np.full((batch,), prompt_len, np.int32),
            np.full((batch,), n, np.int32),
            np.zeros((batch,), np.float32),
            np.zeros((batch,), np.int32),
            np.zeros((batch, 2), np.uint32),
            np.int32(-1),
        )

    def best(n):
        a = args(n)
        jax.block_until_ready(dec.generate(*a))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(dec.generate(*a))
            times.append(time.perf_counter() - t0)
        return min(times)

    t_all, t_one = best(new_tokens), best(1)
    steps = new_tokens - 1
    step_s = (t_all - t_one) / steps
    work = step_work(fns, policy, batch)
    return {
        "cache": policy,
        "batch": batch,
        "prompt_len": prompt_len,
        "prompt_width": width,
        "new_tokens": new_tokens,
        "seconds_total": t_all,
        "seconds_prefill_and_first": t_one,
        "tokens_per_s": batch / step_s,
        "ms_per_step": step_s * 1e3,
        "end_to_end_tokens_per_s": batch * new_tokens / t_all,
        **work,
        "gflops_per_s": work["flops_per_step"] / step_s / 1e9,
        "read_floor_ms": read_seconds(work["bytes_per_step"]) * 1e3,
    }


def batch_table(
    source: Restored,
    batches: tuple[int, ...] = (1, 8, 32),
    prompt_len: int | None = None,
    new_tokens: int | None = None,
    repeats: int = 3,
) -> list[dict]:
    fns = ModelFns(source.model)
    s = fns.shape.max_len
    prompt_len = prompt_len or max(1, s // 8)
    new_tokens = new_tokens or max(1, s // 4)
    return [
        measure_batch(fns, p, b, prompt_len, new_tokens, repeats)
        for p in kv.POLICIES
        for b in batches
    ]


def batch_markdown(rows: list[dict]) -> str:
    headers = ["cache", "batch", "decode tok/s", "ms per decode step", "vs batch 1", "GFLOP/s"]
    headers += ["MB read per step", "ms to read them once", "end-to-end tok/s (with prefill)"]
    one = {r["cache"]: r["tokens_per_s"] for r in rows if r["batch"] == 1}
    cells = []
    for r in rows:
        rel = f"{r['tokens_per_s'] / one[r['cache']]:.1f}x" if r["cache"] in one else "-"
        cells.append(
            (
                r["cache"],
                r["batch"],
                f"{r['tokens_per_s']:.0f}",
                f"{r['ms_per_step']:.3f}",
                rel,
                f"{r['gflops_per_s']:.1f}",
                f"{r['bytes_per_step'] / 1e6:.2f}",
                f"{r['read_floor_ms']:.3f}",
                f"{r['end_to_end_tokens_per_s']:.0f}",
            )
        )
    return table(headers, cells)
