"""Inference subcommands: kvcache, export, verify-export, generate, serve."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tpulab.errors import TpulabError

_POLICIES = ("fp32", "bf16", "int8")


def _kvcache(args) -> int:
    from tpulab.inference.cache_eval import markdown_table, write_kvcache_report
    from tpulab.train.restore import load_model

    out = args.out or args.run_dir / "kvcache"
    result = write_kvcache_report(load_model(args.run_dir, args.step), out)
    print(markdown_table(result))
    print(f"wrote {out}/kvcache.json, kvcache.md, kvcache.png")
    return 0


def _export(args) -> int:
    from tpulab.inference.export import MANIFEST, export_artifacts
    from tpulab.train.restore import load_model

    manifest = export_artifacts(load_model(args.run_dir, args.step), args.run_dir, args.out, batch=args.batch)
    for a in manifest["artifacts"]:
        print(f"{a['file']}  {a['sha256'][:16]}  platforms={','.join(a['platforms'])}")
    print(f"wrote {args.out / MANIFEST} (checkpoint step {manifest['source']['checkpoint_step']})")
    return 0


def _verify(args) -> int:
    from tpulab.inference.export import verification_table, verify_export

    result = verify_export(args.artifacts, args.run_dir)
    print(verification_table(result))
    if not result["passed"]:
        failed = [r["artifact"] for r in result["rows"] if not r["passed"]]
        raise TpulabError(f"verification failed for {', '.join(failed)}", exit_code=1)
    print(f"all {len(result['rows'])} endpoints match checkpoint step {result['checkpoint_step']}")
    return 0


def _generate(args) -> int:
    from tpulab.inference.generate import SamplingConfig, generate_text

    cfg = SamplingConfig(max_new=args.max_new, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    if args.artifacts is not None:
        from tpulab.inference.export import open_artifacts

        engine = open_artifacts(args.artifacts).engine(args.cache)
    else:
        from tpulab.inference.decode import Decoder
        from tpulab.train.restore import load_model

        engine = Decoder.of(load_model(args.run_dir, args.step).model, args.cache)
    sys.stdout.write(args.prompt)
    for piece in generate_text(engine, args.prompt, cfg):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve(args) -> int:
    from tpulab.inference.serve import serve

    serve(args.artifacts, args.host, args.port)
    return 0


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"port {value} is not in 1..65535")
    return value


def register(sub) -> None:
    p = sub.add_parser("kvcache", help="KV-cache precision table (fp32/bf16/int8) against the full forward")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest valid)")
    p.add_argument("--out", type=Path, default=None, help="output dir (default: RUN_DIR/kvcache)")
    p.set_defaults(handler=_kvcache)

    p = sub.add_parser("export", help="serialize prefill/decode endpoints (jax.export) for cpu, tpu and cuda")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest valid)")
    p.add_argument("--batch", type=int, default=1, help="batch size the endpoints are lowered for")
    p.set_defaults(handler=_export)

    p = sub.add_parser("verify-export", help="check an artifact set's hashes and outputs against its checkpoint")
    p.add_argument("artifacts", type=Path)
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where the checkpoint lives (default: the run dir recorded in the manifest)")
    p.set_defaults(handler=_verify)

    p = sub.add_parser("generate", help="stream text from a checkpoint or from exported endpoints")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path)
    src.add_argument("--artifacts", type=Path)
    p.add_argument("--step", type=int, default=None, help="checkpoint step with --run-dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=_POLICIES, default="fp32")
    p.set_defaults(handler=_generate)

    p = sub.add_parser("serve", help="HTTP generation service over verified artifacts (FastAPI + uvicorn)")
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.set_defaults(handler=_serve)
