"""Ahead-of-time compiles for TPU targets on a host without a TPU (libtpu's compiler, no TPU
runtime).

A target is ``GENERATION:TOPOLOGY`` (``v5e:2x2``, ``v5p:2x2x1``). ``get_topology_desc`` returns
abstract TPU devices; a ``Mesh`` over them and the same ``make_steps`` the trainer uses give the
real train step, lowered with abstract arguments and compiled by XLA:TPU. The compiled program
cannot run here, but its ``memory_analysis`` (peak bytes per device) and ``cost_analysis``
(FLOPs, bytes accessed) are the compiler's own numbers. On v5e/v6e ``temp_size_in_bytes`` reads 0
even when activations grow, so ``peak_memory_in_bytes`` is what is reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import time
from typing import TYPE_CHECKING

from tpulab.errors import TpulabError
from tpulab.libtpu_env import quiet_libtpu_off_tpu
from tpulab.perf.chips import CHIPS, Chip

if TYPE_CHECKING:
    from tpulab.train.config import RunConfig

EXAMPLE_TARGETS = (
    "v5e:1x1",
    "v5e:2x2",
    "v5e:2x4",
    "v5e:4x4",
    "v5p:2x2x1",
    "v5p:2x2x2",
    "v6e:1x1",
    "v6e:2x2",
    "v6e:4x4",
    "v4:2x2x1",
)
_TOPOLOGY = re.compile(r"^(\d+)(x\d+){1,2}$")


class TargetError(TpulabError):
    """A TPU target name that cannot be compiled for."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given: v5e:2x2
    chip: Chip
    dims: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.dims)


def accepted() -> str:
    return f"generations {', '.join(CHIPS)}; topologies like {', '.join(EXAMPLE_TARGETS)}"


def parse_target(name: str) -> Target:
    gen, _, topo = name.strip().partition(":")
    if gen not in CHIPS or not _TOPOLOGY.match(topo):
        raise TargetError(
            f"unknown TPU target {name!r}: expected GENERATION:TOPOLOGY with {accepted()}"
        )
    return Target(name.strip(), CHIPS[gen], tuple(int(x) for x in topo.split("x")))


def parse_targets(spec: str) -> list[Target]:
    names = [n for n in spec.split(",") if n.strip()]
    if not names:
        raise TargetError(f"no TPU target given; {accepted()}")
    return [parse_target(n) for n in names]


@functools.cache
def topology_devices(name: str) -> tuple:
    """Abstract TPU devices of a target (libtpu's topology description); TargetError if libtpu
    refuses."""
    target = parse_target(name)
    quiet_libtpu_off_tpu()
    if libtpu_version() is None:
        raise TargetError(
            f"cannot compile for {name}: libtpu (the XLA:TPU compiler) is not installed; "
            "`make setup` installs it on Linux x86_64"
        )
    from jax.experimental import topologies

    kwargs = {"chips_per_host_bounds": (1, 1, 1)} if target.chips == 1 else {}
    try:
        topo = topologies.get_topology_desc(
            topology_name=f"{target.chip.generation}:{'x'.join(map(str, target.dims))}",
            platform="tpu",
            **kwargs,
        )
    except Exception as e:  # libtpu missing or the topology rejected: one line, what would work
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "topology" not in msg.lower():
            raise TargetError(
                f"cannot compile for {name}: libtpu failed to start ({msg[:200]})"
            ) from None
        raise TargetError(
            f"libtpu rejected TPU target {name!r} ({msg[:160]}); {accepted()}"
        ) from None
    return tuple(topo.devices)


def libtpu_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def _no_persistent_cache():
    """A TPU executable compiled without a TPU client can be written to JAX's persistent cache but
    not read back (``DeserializeLoadedExecutable`` needs a client): keep AOT compiles out of it."""
    import warnings

    import jax

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with warnings.catch_warnings():
            # Once a process has used the cache (CPU compiles earlier in `tpulab dossier`), JAX
            # keeps consulting it; the failed read of a TPU entry is then harmless (it compiles)
            # but noisy.
            warnings.filterwarnings(
                "ignore", message="Error reading persistent compilation cache entry"
            )
            yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


class CompilerOutOfMemory(TpulabError):
    """XLA:TPU refused the program: it needs more HBM than a device has (a verdict, not a crash)."""


@contextlib.contextmanager
def _oom_as_verdict(target_name: str):
    try:
        yield
    except Exception as e:  # JaxRuntimeError; matched on the compiler's own status
        msg = str(e).splitlines()[0] if str(e) else ""
        if "RESOURCE_EXHAUSTED" in msg:
            raise CompilerOutOfMemory(f"{target_name}: {msg}") from None
        raise


def read_compiled(compiled) -> dict:
    """The compiler's own numbers for one device's program."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax returned one dict per program
        cost = cost[0] if cost else {}
    return {
        "peak_bytes": int(mem.peak_memory_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
    }


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2}
_DTYPE_BYTES.update({"s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1})
# An instruction line: "%name = SHAPE opcode(...". SHAPE may hold tuples and TPU layouts with
# parentheses ("f32[8,96]{1,0:T(8,128)}"), but never a space followed by "word(".
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dtype, 4)
    return total


def collectives(hlo: str) -> dict:
    """kind -> {count, bytes}: every collective of a compiled module (``compiled.as_text()``), with
    the bytes of its result per device (all-gather: the gathered array; reduce-scatter: the shard).

    Async pairs count once (``-start``). XLA:TPU emits a reduce-scatter as a fusion that calls an
    ``all-reduce-scatter`` computation (an all-reduce and a slice, emitted as one collective,
    ``AllReduceScatterFusion``): that call counts as one reduce-scatter and the all-reduce inside
    its body is not counted again. XLA:CPU has no such pass: there a gradient reduce-scatter stays
    an all-reduce followed by a slice (``benchmarks/results/scaleout_comm.md``).
    """
    out: dict = {}
    inside_fused_reduce_scatter = False
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head and " = " not in line:
            inside_fused_reduce_scatter = head.group("name").startswith("all-reduce-scatter")
            continue
        m = _INSTR.match(line)
        if not m or inside_fused_reduce_scatter:
            continue
        op = m.group("op").removesuffix("-start")
        if op == "fusion" and "calls=%all-reduce-scatter" in line:
            op = "reduce-scatter"
        if op in COLLECTIVES:
            row = out.setdefault(op, {"count": 0, "bytes": 0})
            row["count"] += 1
            row["bytes"] += _shape_bytes(m.group("shape"))
    return out


def compile_train_step(config: RunConfig, target_name: str) -> dict:
    """Compile the trainer's own train step (``make_steps``) for a TPU target; compiler numbers
    per device, and the collectives of its optimized HLO."""
    import jax
    import numpy as np

    from tpulab.train.sharding import make_mesh
    from tpulab.train.step import make_steps

    devices = topology_devices(target_name)
    b, t = config.data.batch_size, config.data.seq_len
    if b % len(devices):
        raise TpulabError(
            f"data.batch_size={b} does not split over the {len(devices)} devices of {target_name}; "
            f"use a multiple of {len(devices)}"
        )
    steps = make_steps(
        config, make_mesh(config.mesh, devices)
    )  # the run's own layout (mesh.fsdp > 1: FSDP)
    sds = lambda dtype: jax.ShapeDtypeStruct((b, t), dtype, sharding=steps.batch_sharding)  # noqa: E731
    batch = {"inputs": sds(np.int32), "targets": sds(np.int32), "mask": sds(np.float32)}
    t0 = time.perf_counter()
    with _no_persistent_cache(), _oom_as_verdict(target_name):
        compiled = steps.train.lower(steps.abstract_state(), batch).compile()
    return {
        **read_compiled(compiled),
        "collectives": collectives(compiled.as_text()),
        "mesh": {"data": steps.mesh.shape["data"], "fsdp": steps.mesh.shape["fsdp"]},
        "compile_s": time.perf_counter() - t0,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
    }


def compile_decode_step(config: RunConfig, target_name: str, batch: int, policy: str) -> dict:
    """Compile one KV-cache decode step (the inference engine's own function) for a TPU target.

    The serving batch is split over the target's devices; weights are replicated.
    """
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpulab.model.decode import ModelFns
    from tpulab.model.transformer import Transformer

    devices = topology_devices(target_name)
    if batch % len(devices):
        raise TpulabError(
            f"serve batch {batch} does not split over the {len(devices)} devices of {target_name}"
        )
    mesh = Mesh(np.array(devices), ("data",))
    fns = ModelFns(
        nnx.eval_shape(lambda: Transformer(config.model, config.precision, rngs=nnx.Rngs(0)))
    )
    params, cache, token, pos = fns.example_args("decode", policy, batch)
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "data"))
    cache_sh = jax.tree.map(lambda _: split, cache)
    fn = jax.jit(
        fns.decode,
        in_shardings=(
            jax.tree.map(lambda _: rep, params),
            cache_sh,
            NamedSharding(mesh, P("data")),
            rep,
        ),
        out_shardings=(NamedSharding(mesh, P("data")), cache_sh),
        donate_argnums=(1,),
    )
    t0 = time.perf_counter()
    with _no_persistent_cache(), _oom_as_verdict(target_name):
        compiled = fn.lower(params, cache, token, pos).compile()
    return {
        **read_compiled(compiled),
        "compile_s": time.perf_counter() - t0,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
    }
