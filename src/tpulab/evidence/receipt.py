"""The runtime receipt: what JAX reports about this machine, backed by work its devices did.

A receipt is not a list of claims. Besides the inventory (backend, device kinds, ids, coordinates,
processes, versions, the environment variables that decide the runtime) it carries three pieces of
runtime evidence: a collective in which device i contributes i+1 and the psum must equal n(n+1)/2
on every device (more than any device's own value when n > 1, so a "collective" that returned its
input fails; on one device a sum is its input, and the check says it is trivial), a timed matmul
checked against NumPy, and a device-to-host round trip checked byte for byte. Target
qualification (``--expect tpu:v5e``) compares the receipt with what the user meant to run on and
names the first mismatch; it never trusts the cloud's word.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path

import numpy as np

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json, check_out
from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence import report_kit
from tpulab.evidence.provenance import git_commit
from tpulab.libtpu_env import MARKER, placeholders

RECEIPT = "receipt.json"
TABLE = "receipt.md"
ENV_PREFIXES = ("TPU_", "JAX_", "XLA_", "LIBTPU", "MEGASCALE_", "CLOUD_TPU", "TPULAB_")
VERSION_PACKAGES = ("jax", "jaxlib", "libtpu", "libtpu-nightly", "tpulab")

# Generation name -> the device_kind strings JAX reports for it (normalized: lower case, no spaces).
TPU_KINDS = {
    "v2": ("tpuv2",),
    "v3": ("tpuv3",),
    "v4": ("tpuv4",),
    "v5e": ("tpuv5lite", "tpuv5e"),
    "v5p": ("tpuv5p", "tpuv5"),
    "v6e": ("tpuv6lite", "tpuv6e"),
    "v7": ("tpu7x", "tpuv7"),
}


class QualificationError(TpulabError):
    """The runtime is not the target the user asked for."""

    exit_code = ExitCode.WRONG_TARGET


@dataclasses.dataclass(frozen=True)
class Target:
    """A target as the user names it (``cpu``, ``gpu[:kind]``, ``tpu[:generation]``), a count."""

    backend: str
    kind: str | None = None
    devices: int | None = None

    @classmethod
    def parse(cls, text: str, devices: int | None = None) -> Target:
        backend, _, kind = text.strip().lower().partition(":")
        if backend not in ("cpu", "gpu", "tpu") or (kind == "" and ":" in text):
            raise TpulabError(f"--expect must look like tpu:v5e, tpu, gpu or cpu, got {text!r}")
        if backend == "tpu" and kind and kind not in TPU_KINDS:
            raise TpulabError(
                f"unknown TPU generation {kind!r} in --expect (known: {', '.join(TPU_KINDS)})"
            )
        if devices is not None and devices < 1:
            raise TpulabError(f"--expect-devices must be at least 1, got {devices}")
        return cls(backend, kind or None, devices)

    def __str__(self) -> str:
        return (
            self.backend
            + (f":{self.kind}" if self.kind else "")
            + (f" x{self.devices}" if self.devices else "")
        )


def _norm(kind: str) -> str:
    return re.sub(r"\s+", "", kind.lower())


def kind_matches(target: Target, device_kind: str) -> bool:
    if target.kind is None:
        return True
    names = (
        TPU_KINDS.get(target.kind, (_norm(target.kind),))
        if target.backend == "tpu"
        else (_norm(target.kind),)
    )
    got = _norm(device_kind)
    # Exact for TPU generations ("tpuv5" must not accept "tpuv5lite"), substring for GPU names.
    return got in names if target.backend == "tpu" else any(n in got for n in names)


def qualify(receipt: dict, target: Target) -> list[str]:
    """Every way the receipt falls short of the target; empty means qualified."""
    problems = []
    rt = receipt["runtime"]
    if rt["backend"] != target.backend:
        problems.append(
            f"expected backend {target.backend}, JAX reports backend {rt['backend']} "
            f"({', '.join(rt['device_kinds'])} x{rt['device_count']})"
        )
    elif not all(kind_matches(target, k) for k in rt["device_kinds"]):
        problems.append(f"expected {target}, device kind is {', '.join(rt['device_kinds'])}")
    if target.devices is not None and rt["device_count"] != target.devices:
        problems.append(f"expected {target.devices} devices, JAX reports {rt['device_count']}")
    failed = [name for name, check in receipt["evidence"].items() if not check["passed"]]
    if failed:
        problems.append(f"runtime evidence failed: {', '.join(failed)}")
    return problems


# --- runtime evidence -------------------------------------------------------------------------


def check_collective(values: list[float], n: int) -> dict:
    """The psum every device holds must be 1 + 2 + ... + n; one wrong device fails the check.

    Device i contributes i+1 (not i: with indices, one device's expected sum 0 is its own input,
    and on two devices device 1's input 1 is the sum). For n > 1 the sum exceeds every input, so
    an op that returns its input fails; for n = 1 nothing can tell a sum from its input, so the
    check passes as ``trivial`` and says so wherever it is quoted."""
    expected = n * (n + 1) / 2
    wrong = [i for i, v in enumerate(values) if v != expected]
    return {
        "passed": bool(values) and not wrong,
        "trivial": n == 1,
        "expected": expected,
        "values": values,
        "wrong_shards": wrong,
    }


def collective_summary(receipt: dict) -> str:
    """How reports quote the collective: what it proved, or that on one device it proves nothing."""
    coll = receipt["evidence"]["collective"]
    verdict = "passed" if coll["passed"] else "FAILED"
    if coll.get("trivial"):
        return (
            f"a collective on 1 device, {verdict} but trivial (a sum over one device is its input)"
        )
    return (
        f"a psum across all {coll['devices']} devices, {verdict} (expected {coll['expected']:g} on "
        "each, more than any device's own value)"
    )


def collective_evidence() -> dict:
    """psum over a 1-D mesh of all global devices, the shard on device i holding i+1."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    x = jax.make_array_from_callback(
        (n,), sharding, lambda idx: np.arange(1, n + 1, dtype=np.float32)[idx]
    )

    @jax.jit
    def total(a):
        return jax.shard_map(
            lambda s: jax.lax.psum(s, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")
        )(a)

    t0 = time.perf_counter()
    out = jax.block_until_ready(total(x))
    elapsed = time.perf_counter() - t0
    shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start or 0)
    values = [float(np.asarray(s.data)[0]) for s in shards]
    result = check_collective(values, n)
    result.update(
        op="psum over shard_map",
        devices=n,
        checked_local_shards=len(values),
        seconds_incl_compile=round(elapsed, 4),
    )
    return result


def check_matmul(
    got: np.ndarray, a: np.ndarray, b: np.ndarray, tol: float = 1e-2
) -> tuple[float, bool]:
    """Relative Frobenius error against float64 NumPy; loose enough for bf16, not for wrong math."""
    want = a.astype(np.float64) @ b.astype(np.float64)
    rel_err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    return rel_err, bool(np.isfinite(rel_err) and rel_err < tol)


def matmul_evidence(size: int, reps: int = 5) -> dict:
    """A timed (size x size) float32 matmul on the default device, its result checked by NumPy."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    da, db = jax.device_put(a), jax.device_put(b)
    mm = jax.jit(jnp.matmul)
    got = np.asarray(jax.block_until_ready(mm(da, db)))  # compiles
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(da, db))
        times.append(time.perf_counter() - t0)
    rel_err, passed = check_matmul(got, a, b)
    best = min(times)
    return {
        "passed": passed,
        "shape": [size, size],
        "dtype": "float32",
        "precision": "default",
        "relative_error_vs_numpy": rel_err,
        "best_s": best,
        "median_s": float(np.median(times)),
        "reps": reps,
        "tflops_best": 2 * size**3 / best / 1e12,
        "device": str(da.devices().pop()),
    }


def round_trip_evidence(nbytes: int = 1 << 20) -> dict:
    """Host -> every local device -> host, compared byte for byte."""
    import jax

    data = np.random.default_rng(1).integers(0, 255, size=nbytes, dtype=np.uint8)
    results = []
    for d in jax.local_devices():
        t0 = time.perf_counter()
        back = np.asarray(jax.device_get(jax.device_put(data, d)))
        results.append(
            {
                "device_id": d.id,
                "equal": bool(np.array_equal(back, data)),
                "seconds": round(time.perf_counter() - t0, 5),
            }
        )
    return {
        "passed": bool(results) and all(r["equal"] for r in results),
        "bytes": nbytes,
        "devices": results,
    }


# --- inventory --------------------------------------------------------------------------------


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in VERSION_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            if name in ("jax", "jaxlib", "tpulab"):
                out[name] = None
    out["tpulab_commit"] = (
        git_commit()
    )  # None for an installed wheel; the stage record names its commit
    out["tpulab_path"] = str(Path(__file__).resolve().parents[1])
    return out


def _device(d) -> dict:
    info = {
        "id": d.id,
        "kind": d.device_kind,
        "platform": d.platform,
        "process_index": d.process_index,
    }
    for attr in ("coords", "core_on_chip", "num_cores", "slice_index"):
        v = getattr(d, attr, None)
        if v is not None:
            info[attr] = list(v) if isinstance(v, (tuple, list)) else v
    return info


def runtime_inventory() -> dict:
    import jax

    devices = jax.devices()
    local = jax.local_devices()
    return {
        "backend": jax.default_backend(),
        "platform_version": devices[0].client.platform_version,
        "device_kinds": sorted({d.device_kind for d in devices}),
        "device_count": len(devices),
        "local_device_count": len(local),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": [_device(d) for d in devices],
        "local_device_ids": [d.id for d in local],
    }


def runtime_env() -> dict:
    """The variables that decide the runtime, less tpulab's libtpu placeholders (listed apart)."""
    ours = placeholders() | {MARKER}
    return {
        k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) and k not in ours
    }


def collect(matmul_size: int = 512) -> dict:
    """Inventory plus evidence; each check records ``passed`` so a reader can re-judge it."""
    t0 = time.time()
    receipt = {
        "format": 1,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "runtime": runtime_inventory(),
        "versions": _versions(),
        "env": runtime_env(),
        "tpulab_placeholders": sorted(placeholders()),
    }
    receipt["evidence"] = {
        "collective": collective_evidence(),
        "matmul": matmul_evidence(matmul_size),
        "round_trip": round_trip_evidence(),
    }
    return receipt


def hardware_line(receipt: dict) -> str:
    """One line for reports, the backend as JAX reported it: TPU appears only for a tpu backend."""
    rt = receipt["runtime"]
    return f"{rt['backend'].upper()} ({', '.join(rt['device_kinds'])}) x{rt['device_count']}"


def key_values(receipt: dict) -> list[tuple[str, str]]:
    """The receipt as (what, value) pairs: ``table`` aligns them for a terminal, ``markdown``
    makes them a table for receipt.md and the capstone's report."""
    rt, ev, v = receipt["runtime"], receipt["evidence"], receipt["versions"]
    coll, mm, rtp = ev["collective"], ev["matmul"], ev["round_trip"]
    rows = [
        ("hardware", hardware_line(receipt)),
        ("platform version", rt["platform_version"]),
        ("devices (global / local)", f"{rt['device_count']} / {rt['local_device_count']}"),
        ("process", f"{rt['process_index']} of {rt['process_count']} on {receipt['host']}"),
        ("device ids", ", ".join(str(d["id"]) for d in rt["devices"])),
        (
            "coords",
            "; ".join(str(d.get("coords")) for d in rt["devices"] if "coords" in d) or "n/a",
        ),
        ("versions", ", ".join(f"{k} {val}" for k, val in v.items() if val is not None)),
        (
            "runtime env",
            ", ".join(f"{k}={val}" for k, val in receipt["env"].items()) or "(none set)",
        ),
        (
            "tpulab placeholders",
            ", ".join(receipt.get("tpulab_placeholders", [])) + " (set by tpulab to quiet "
            "libtpu on this host; not the runtime's)"
            if receipt.get("tpulab_placeholders")
            else "(none)",
        ),
        (
            "collective",
            f"{'PASS' if coll['passed'] else 'FAIL'}"
            f"{' (trivial: on one device a sum is its input)' if coll.get('trivial') else ''}: "
            f"psum of i+1 on device i = {coll['values'][:4]}"
            f"{' ...' if len(coll['values']) > 4 else ''}, expected {coll['expected']:g} on each "
            f"of {coll['devices']} devices",
        ),
        (
            "matmul",
            f"{'PASS' if mm['passed'] else 'FAIL'}: {mm['shape'][0]}x{mm['shape'][1]} "
            f"{mm['dtype']}, "
            f"rel. error {mm['relative_error_vs_numpy']:.1e}, best {mm['best_s'] * 1e3:.2f} ms "
            f"({mm['tflops_best']:.3f} TFLOP/s)",
        ),
        (
            "device->host",
            f"{'PASS' if rtp['passed'] else 'FAIL'}: {rtp['bytes']} bytes on {len(rtp['devices'])} "
            "local devices, byte-identical",
        ),
    ]
    if "qualification" in receipt:
        q = receipt["qualification"]
        verdict = "QUALIFIED" if q["passed"] else "NOT QUALIFIED: " + "; ".join(q["problems"])
        rows.append(("target", f"{q['target']}: {verdict}"))
    return rows


def table(receipt: dict) -> str:
    """Aligned ``what  value`` lines, for a terminal."""
    pairs = key_values(receipt)
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)}  {val}" for k, val in pairs) + "\n"


def markdown(receipt: dict) -> str:
    """A two-column Markdown table: as lines, a Markdown renderer runs them into one paragraph."""
    return report_kit.table(["what", "value"], key_values(receipt)) + "\n"


def receipt_name(receipt: dict) -> str:
    rt = receipt["runtime"]
    return RECEIPT if rt["process_count"] == 1 else f"receipt-p{rt['process_index']}.json"


def _only_receipts(out: Path) -> bool:
    """The processes of one job share a receipt dir, each writing its own ``receipt-p<i>``: a dir
    holding nothing but receipts (a sibling's write in flight too) and ``tpulab launch``'s own
    ``launch/`` logs may take one more."""
    return all(
        re.fullmatch(r"\.?receipt(-p\d+)?\.(json|md)(\.tmp-\d+)?", p.name)
        or (p.name == "launch" and p.is_dir())
        for p in out.iterdir()
    )


def run_receipt(out_dir: str | Path, target: Target | None = None, matmul_size: int = 512) -> dict:
    """Collect, write ``receipt.json`` and ``receipt.md`` under ``out_dir``, then judge.

    The receipt is written even when it fails (it is the evidence of the failure). Raises
    QualificationError (one line, ``ExitCode.WRONG_TARGET``) when the target does not match,
    TpulabError (``ExitCode.FAILED``)
    when any runtime evidence fails; returns the receipt otherwise. The capstone calls this.
    """
    out = check_out(out_dir, reuse=_only_receipts)
    if matmul_size < 1:
        raise TpulabError(f"--matmul-size must be at least 1, got {matmul_size}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TpulabError(f"cannot create receipt dir {out}: {e.strerror}") from None
    receipt = collect(matmul_size)
    if target is not None:
        problems = qualify(receipt, target)
        receipt["qualification"] = {
            "target": str(target),
            "passed": not problems,
            "problems": problems,
        }
    name = receipt_name(receipt)
    atomic_write_json(out / name, receipt)
    atomic_write_bytes(out / (Path(name).stem + ".md"), markdown(receipt).encode())
    if target is not None and receipt["qualification"]["problems"]:
        raise QualificationError(
            f"target qualification failed ({target}): "
            + "; ".join(receipt["qualification"]["problems"])
        )
    failed = [k for k, c in receipt["evidence"].items() if not c["passed"]]
    if failed:
        raise TpulabError(
            f"runtime evidence failed: {', '.join(failed)} (see {out / name})",
            exit_code=ExitCode.FAILED,
        )
    return receipt
