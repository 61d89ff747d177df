"""The serving drift alarm's window and threshold, measured with the statistic the service computes.

    python benchmarks/drift_threshold.py [--sizes 2048 4096 8192 16384] \
        [--out benchmarks/results/drift_threshold]

Reference: the byte histogram of the default corpus's training documents (the split every config
uses unless it sets data.split_seed / val_fraction). Each source is sent as prompts, one line each
(with its newline: text in the corpus's own format; and again without it, as a client that strips
lines would send it), through ``tpulab.data.drift.DriftWindow`` exactly as the service feeds it;
every window position after the first full one is a value. Sources: the training plays
(in-sample), the held-out plays, and text that is not Shakespeare and ships in every clone (this
repository's Markdown docs: English prose; its Python sources), plus the GPL-3 text from
/usr/share/common-licenses when the host has it. Prints per source the min, median, 99th
percentile and max JSD and how many windows exceed the threshold; writes OUT.json and OUT.md.
A measurement, run by hand, deterministic (no sampling); about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tpulab.evidence.report_kit import table

REPO = Path(__file__).resolve().parents[1]


def sources() -> tuple[dict[str, list[bytes]], list[bytes]]:
    from tpulab.data.config import DataConfig
    from tpulab.data.corpus import load_corpus
    from tpulab.data.pipeline import split_documents

    train, val = split_documents(load_corpus(None), DataConfig())
    out = {
        "training plays (in-sample)": [d.data for d in train],
        "held-out plays": [d.data for d in val],
        "repo docs (English prose)": [
            b"".join(p.read_bytes() for p in sorted([REPO / "README.md", *REPO.glob("docs/*.md")]))
        ],
        "repo Python sources": [b"".join(p.read_bytes() for p in sorted(REPO.glob("src/**/*.py")))],
    }
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.is_file():
        out["GPL-3 (English legal prose)"] = [gpl.read_bytes()]
    return out, [d.data for d in train]


def sweep(docs: list[bytes], reference, size: int, newlines: bool) -> list[float]:
    """JSD at every window position of each document sent line by line (documents apart)."""
    from tpulab.data.drift import DriftWindow

    values = []
    for doc in docs:
        window = DriftWindow(reference, window_bytes=size)
        for line in doc.splitlines(keepends=newlines):
            window.observe(line)
            if window.bytes >= size:
                values.append(window.value())
    return values


def render(result: dict) -> str:
    """OUT.md from OUT.json: what was measured and one row per (prompts, source, window)."""
    headers = ["prompts", "source", "window bytes", "windows", "min", "median", "p99", "max"]
    rows = [
        (
            r["prompts"],
            r["source"],
            r["window_bytes"],
            r["windows"],
            *(f"{r[k]:.4f}" for k in ("min", "median", "p99", "max")),
            r["over_threshold"],
        )
        for r in result["rows"]
    ]
    return "\n".join(
        [
            f"JSD (bits) of the drift window against the training plays' byte histogram; the "
            f"service's threshold {result['threshold']} and window {result['window_bytes']} "
            "bytes; every window position.",
            "",
            table([*headers, "over threshold"], rows),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()

    from tpulab.process_setup import prepare

    prepare()  # as the CLI does: the provenance below starts JAX
    from tpulab.data.drift import THRESHOLD, WINDOW_BYTES, byte_histogram
    from tpulab.evidence.provenance import environment

    by_source, train = sources()
    ref = sum(byte_histogram(d) for d in train)
    rows = []
    for newlines in (True, False):
        for size in args.sizes:
            for name, docs in by_source.items():
                v = np.array(sweep(docs, ref, size, newlines))
                rows.append(
                    {
                        "source": name,
                        "prompts": "lines with their newline" if newlines else "lines, stripped",
                        "window_bytes": size,
                        "windows": int(v.size),
                        "min": float(v.min()),
                        "median": float(np.median(v)),
                        "p99": float(np.percentile(v, 99)),
                        "max": float(v.max()),
                        "over_threshold": int((v > THRESHOLD).sum()),
                    }
                )
                print(rows[-1], flush=True)
    result = {"threshold": THRESHOLD, "window_bytes": WINDOW_BYTES, "rows": rows}
    text = render(result)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result["environment"] = environment()
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
