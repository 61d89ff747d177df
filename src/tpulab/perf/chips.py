"""Published per-chip figures of TPU generations: the one place tpulab keeps them.

Each row is one chip (what a topology name like ``v5e:2x2`` counts), from Google Cloud's TPU
system-architecture pages (cited per row, as read in 2025). ``jax_device_kind`` is what JAX reports
for that generation's devices, which is how a measured run is matched to its row; v4 and v5p
chips have two TensorCores: libtpu shows a v5p chip as one (megacore) device and a v4 chip
as two devices, so per-device figures are derived from the device count of the compiled topology
(``tpulab.perf.aot``), never stored twice.
"""

from __future__ import annotations

import dataclasses

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    generation: str  # the prefix of a topology name: v5e, v5p, v6e, v4
    jax_device_kind: str
    peak_bf16_flops: float  # FLOP/s per chip, dense bf16
    peak_int8_ops: float  # OP/s per chip, int8
    hbm_bytes: int
    hbm_bytes_per_s: float
    source: str

    def ridge(self, dtype: str = "bf16") -> float:
        """FLOPs per HBM byte above which a step is compute-bound here (peak / bandwidth)."""
        peak = self.peak_int8_ops if dtype == "int8" else self.peak_bf16_flops
        return peak / self.hbm_bytes_per_s


CHIPS: dict[str, Chip] = {
    c.generation: c
    for c in (
        Chip(
            "v4",
            "TPU v4",
            275e12,
            275e12,
            32 * GiB,
            1200e9,
            "https://cloud.google.com/tpu/docs/v4 "
            "(275 TFLOPS bf16 or int8, 32 GiB HBM2, 1200 GBps)",
        ),
        Chip(
            "v5e",
            "TPU v5 lite",
            197e12,
            394e12,
            16 * GiB,
            819e9,
            "https://cloud.google.com/tpu/docs/v5e "
            "(197 TFLOPS bf16, 394 TOPS int8, 16 GiB HBM2, 819 GB/s)",
        ),
        Chip(
            "v5p",
            "TPU v5",
            459e12,
            918e12,
            95 * GiB,
            2765e9,
            "https://cloud.google.com/tpu/docs/v5p "
            "(459 TFLOPS bf16, 918 TOPS int8, 95 GiB HBM2e, 2765 GB/s)",
        ),
        Chip(
            "v6e",
            "TPU v6 lite",
            918e12,
            1836e12,
            32 * GiB,
            1640e9,
            "https://cloud.google.com/tpu/docs/v6e "
            "(918 TFLOPS bf16, 1836 TOPS int8, 32 GiB HBM, 1640 GB/s)",
        ),
    )
}


def chip_for_device_kind(device_kind: str) -> Chip | None:
    """The row for a device JAX reported, or None (CPU, GPU, unlisted TPU): no peak is invented."""
    for chip in CHIPS.values():
        if chip.jax_device_kind == device_kind:
            return chip
    return None
