"""`tpulab profile`: a trace of K warmed train steps and a top-ops table computed from it.

The steps are the run's own: its objective (``objective.kind``, through the registry) builds them
and gives the abstract state its newest checkpoint is restored into, and its first training batch
is what every step trains on.

The trace (``jax.profiler.trace``, each step inside a ``StepTraceAnnotation``) stays in
``DIR/profile/`` as ``*.xplane.pb`` (XProf/TensorBoard: ``xprof --logdir DIR/profile`` with the
optional ``xprof`` package) and ``*.trace.json.gz`` (drag into https://ui.perfetto.dev). The table
needs no extra package: ``jax.profiler.ProfileData`` reads the xplane in-process; every event with
an ``hlo_op`` stat from the train step's module is one HLO op or fusion executing. Its category is
read from the compiled step's own HLO (not guessed from names: on XLA:CPU a ``ynn_fusion`` may be
a GEMM or a reduction): matmul (a dot or convolution, alone or inside a fusion),
copy/transposition, collective, rng (random-bit generation, i.e. dropout masks), fusion (other
fused elementwise/reduction work), other; host is the rest of the step's wall time that no HLO op
covers (dispatch, Python, waiting). On a GPU the op times are the kernels' device time (see
``read_trace``); profile with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` so that XLA launches
ops one by one instead of as one CUDA graph (``command_buffer_N``).

The same steps are also timed without the profiler, half before and half after the trace (so a
change in host load hits both), and the profiled median is checked against that unprofiled median
(within ``AGREEMENT``). The host tracer runs at level 1 and Python tracing is off: at the default
level a 1 ms step was measured at 2-4 ms under the profiler.
"""

from __future__ import annotations

import collections
import re
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

from tpulab.errors import TpulabError
from tpulab.evidence.report_kit import table

AGREEMENT = 0.10
_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S+.*?\s([a-z][\w\-]*)\((.*)$")
_CALLEE = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_categories(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> category, from a compiled module's text (fusions judged by what
    they call)."""
    comps: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)
    current = None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if (
            m and not line[:1].isspace()
        ):  # computation headers are unindented; instructions are indented
            current = m.group(1)
            continue
        if current is None:
            continue
        i = _INSTR.match(line)
        if i:
            comps[current].append((i.group(1), i.group(2), i.group(3)))

    def kind_of_comp(name: str, seen=()) -> set[str]:
        kinds = set()
        for _, opcode, rest in comps.get(name, []):
            kinds.add(opcode)
            for callee in re.findall(_CALLEE, rest):
                if callee not in seen:
                    kinds |= kind_of_comp(callee, seen + (name,))
        return kinds

    out = {}
    for comp in comps.values():
        for name, opcode, rest in comp:
            kinds = {opcode}
            for callee in re.findall(_CALLEE, rest):
                kinds |= kind_of_comp(callee)
            out[name] = _category(opcode, kinds)
    return out


def _category(opcode: str, kinds: set[str]) -> str:
    if kinds & {"dot", "convolution"}:
        return "matmul"
    if any(k.startswith(c) for k in kinds for c in _COLLECTIVES):
        return "collective"
    if {"xor", "shift-right-logical"} <= kinds or "rng-bit-generator" in kinds:
        return (
            "rng (random bits)"  # threefry lowers to u32 shifts and xors; dropout masks start here
        )
    if opcode in ("copy", "transpose") or (
        opcode == "fusion" and kinds - {"fusion", "parameter", "bitcast"} <= {"copy", "transpose"}
    ):
        return "copy/transposition"
    if opcode == "fusion":
        return "fusion"
    return "other"


def read_trace(xplane: Path, module: str = "jit_train_step") -> dict:
    """Step annotations and per-op time of one module from an xplane file.

    Op time comes from the accelerator's planes (``/device:GPU:0``: kernel time on the device)
    when they hold ops of the module, else from the host plane (XLA:CPU runs its ops on host
    threads). Reading both would count an op twice on a GPU: once as the host's launch, once as the
    kernel."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    steps = []
    ops = {"device": collections.defaultdict(float), "host": collections.defaultdict(float)}
    counts = {"device": collections.Counter(), "host": collections.Counter()}
    for plane in data.planes:
        where = "device" if plane.name.startswith("/device:") else "host"
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                if "step_num" in stats:
                    steps.append((int(stats["step_num"]), ev.duration_ns / 1e9))
                elif "hlo_op" in stats and stats.get("hlo_module") == module:
                    ops[where][str(stats["hlo_op"])] += ev.duration_ns / 1e9
                    counts[where][str(stats["hlo_op"])] += 1
    source = "device" if ops["device"] else "host"
    return {
        "steps": sorted(steps),
        "op_seconds": dict(ops[source]),
        "op_counts": dict(counts[source]),
        "op_time_source": source,
    }


def top_ops(
    trace: dict, categories: dict[str, str], n_steps: int, step_s: float, top: int = 15
) -> dict:
    per_step = {op: s / n_steps for op, s in trace["op_seconds"].items()}
    by_cat = collections.defaultdict(float)
    for op, s in per_step.items():
        by_cat[categories.get(op, "other")] += s
    op_total = sum(per_step.values())
    gap = (
        "gaps (step time no device op covers: launches, host)"
        if trace.get("op_time_source") == "device"
        else "host (step time not inside an HLO op)"
    )
    by_cat[gap] = max(step_s - op_total, 0.0)
    rows = [
        {
            "op": op,
            "category": categories.get(op, "other"),
            "ms_per_step": 1e3 * s,
            "share_of_step": s / step_s,
        }
        for op, s in sorted(per_step.items(), key=lambda kv: -kv[1])[:top]
    ]
    return {
        "ops": rows,
        "categories": {
            k: {"ms_per_step": 1e3 * v, "share_of_step": v / step_s}
            for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])
        },
        "op_time_per_step_ms": 1e3 * op_total,
        "op_time_source": trace.get("op_time_source", "host"),
        "note": (
            "op time is kernel time on the device plane; kernels on several streams may overlap, "
            "and the rest of the step is launch gaps and host work"
            if trace.get("op_time_source") == "device"
            else "op time is from the host plane: ops on XLA:CPU may run on several threads at "
            "once, so op shares can add up past 100%"
        ),
    }


class Loaded(NamedTuple):
    config: Any  # the run's RunConfig
    steps: Any  # its objective's Steps
    state: Any  # restored from the checkpoint
    abstract_state: Any  # what it was restored into: the objective's abstract_state
    batch: dict  # the objective's first training batch (empty: the state carries its data)
    step: int  # the checkpoint's


def load_train_state(run_dir: Path) -> Loaded:
    """A run dir's newest valid checkpoint, ready to train on: the run's own objective
    (``objective.kind``, through the registry) builds the steps and says the state's shapes
    (``abstract_state``), which the checkpoint is restored into; one-line error without a
    checkpoint."""
    from tpulab.checkpoint.rundir import RunDir
    from tpulab.checkpoint.store import CheckpointStore
    from tpulab.config import from_dict
    from tpulab.errors import CheckpointError
    from tpulab.train.config import RunConfig
    from tpulab.train.registry import objective_class
    from tpulab.train.step import make_mesh

    ckpt_dir = RunDir(run_dir).checkpoints
    if not ckpt_dir.is_dir():
        raise TpulabError(
            f"{run_dir} holds no checkpoints to profile "
            f"(train first: tpulab train --run-dir {run_dir})"
        )
    store = CheckpointStore(ckpt_dir, keep=1_000_000, async_save=False)
    try:
        step = store.latest
        if step is None:
            raise CheckpointError(f"{ckpt_dir} holds no valid checkpoint to profile")
        config = from_dict(RunConfig, store.read_meta(step)["config"])
        objective = objective_class(config.objective.kind)(config)  # reads what the run read
        mesh = make_mesh(config)
        steps = objective.steps(mesh)
        target = type(objective).abstract_state(config, mesh)
        train = objective.data().train  # None: the state carries its own data
        batch = {} if train is None else next(train(0, 1))
        return Loaded(config, steps, store.restore(step, target, None), target, batch, step)
    finally:
        store.close()


def profile_run(run_dir: str | Path, *, steps: int = 5, warmup: int = 3, timed: int = 20) -> dict:
    """Profile K warmed train steps of a trained run (its objective's steps on its first training
    batch, from its checkpointed state); write DIR/profile/."""
    import jax

    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.perf.timing import benchmark_environment, summarize, time_steps

    if steps < 1:
        raise TpulabError(f"--steps {steps}: profile at least one step")
    run_dir = Path(run_dir)
    loaded = load_train_state(run_dir)
    s, ckpt_step = loaded.steps, loaded.step
    batch = s.put_batch(loaded.batch)
    holder = {"state": loaded.state}

    def one():
        holder["state"], metrics = s.train(holder["state"], batch)
        return holder["state"], metrics

    before = time_steps(one, jax.block_until_ready, timed // 2, warmup=warmup)
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    trace_dir = out / "trace"
    t0 = time.perf_counter()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = (
        0  # Python call tracing would inflate the step; XLA ops are host-tracer events
    )
    options.host_tracer_level = 1
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                jax.block_until_ready(one())
    trace_wall = time.perf_counter() - t0
    after = time_steps(one, jax.block_until_ready, timed - timed // 2)
    unprofiled = summarize(
        before + after
    )  # half before, half after the trace: host-load drift hits both
    xplanes = sorted(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not xplanes:
        raise TpulabError(f"the profiler wrote no *.xplane.pb under {trace_dir}")
    trace = read_trace(xplanes[-1])
    step_times = [d for _, d in trace["steps"]]
    if len(step_times) != steps:
        raise TpulabError(f"the trace holds {len(step_times)} step annotations, expected {steps}")
    profiled = statistics.median(step_times)
    hlo = (
        s.train.lower(
            loaded.abstract_state,
            jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s.batch_sharding), batch
            ),
        )
        .compile()
        .as_text()
    )
    table = top_ops(trace, hlo_categories(hlo), steps, profiled)
    rel = abs(profiled - unprofiled["median_s"]) / unprofiled["median_s"]
    result = {
        "checkpoint_step": ckpt_step,
        "profiled_steps": steps,
        "profiled_step_median_s": profiled,
        "profiled_step_times_s": step_times,
        "unprofiled": unprofiled,
        "relative_difference": rel,
        "agrees_within": AGREEMENT,
        "agrees": rel <= AGREEMENT,
        "trace_wall_s": trace_wall,
        "xplane": str(xplanes[-1].relative_to(run_dir)),
        "perfetto": [str(p.relative_to(run_dir)) for p in trace_dir.rglob("*.trace.json.gz")],
        "how_to_open": "XProf/TensorBoard: pip install xprof; xprof --logdir DIR/profile/trace. "
        "Perfetto: open the *.trace.json.gz at https://ui.perfetto.dev",
        **table,
        "environment": benchmark_environment(),
        "batches": "fixed synthetic token ids",
    }
    atomic_write_json(out / "profile.json", result)
    atomic_write_bytes(out / "profile.md", (markdown(result) + "\n").encode())
    return result


def markdown(r: dict) -> str:
    un = r["unprofiled"]
    verdict = "agrees" if r["agrees"] else "DOES NOT agree"
    lines = [
        f"Profiled step (median of {r['profiled_steps']}): "
        f"{1e3 * r['profiled_step_median_s']:.2f} ms; "
        f"unprofiled median of {un['steps']}: {1e3 * un['median_s']:.2f} ms "
        f"({100 * r['relative_difference']:.1f}% apart: {verdict} "
        f"within {100 * r['agrees_within']:.0f}%)",
        "",
        table(
            ["category", "ms/step", "share of step"],
            [
                (k, f"{v['ms_per_step']:.2f}", f"{100 * v['share_of_step']:.1f}%")
                for k, v in r["categories"].items()
            ],
        ),
        "",
        table(
            ["HLO op / fusion", "category", "ms/step", "share of step"],
            [
                (
                    o["op"],
                    o["category"],
                    f"{o['ms_per_step']:.2f}",
                    f"{100 * o['share_of_step']:.1f}%",
                )
                for o in r["ops"]
            ],
        ),
    ]
    lines += ["", r["note"], f"Trace: {r['xplane']} — {r['how_to_open']}"]
    return "\n".join(lines)
