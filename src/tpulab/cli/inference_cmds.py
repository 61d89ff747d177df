"""Inference subcommands: kvcache, export, verify-export, generate, serve, serve-bench."""

from __future__ import annotations

import argparse
import sys

from tpulab.cli.args import from_flags, path_arg
from tpulab.errors import ExitCode, TpulabError
from tpulab.model.policies import POLICIES as _POLICIES


def cmd_kvcache(args) -> int:
    from tpulab.checkpoint.files import check_out, holds_only
    from tpulab.inference.cache_eval import KVCACHE_FILES, markdown_table, write_kvcache_report
    from tpulab.train.restore import load_model

    # its own earlier report (these three files alone) is rewritten; anything else is in the way
    out = check_out(args.out or args.run_dir / "kvcache", reuse=holds_only(*KVCACHE_FILES))
    result = write_kvcache_report(load_model(args.run_dir, args.step), out)
    print(markdown_table(result))
    print(f"wrote {out}/{', '.join(KVCACHE_FILES)}")
    return ExitCode.OK


def cmd_export(args) -> int:
    from tpulab.checkpoint.files import check_out
    from tpulab.inference.artifact_format import ARTIFACT_MANIFEST
    from tpulab.inference.export import export_artifacts
    from tpulab.train.restore import load_model

    check_out(args.out)  # before the model is read: a set is never written over a user's files
    manifest = export_artifacts(
        load_model(args.run_dir, args.step), args.run_dir, args.out, batch=args.batch
    )
    for a in manifest["artifacts"]:
        print(f"{a['file']}  {a['sha256'][:16]}  platforms={','.join(a['platforms'])}")
    step = manifest["source"]["checkpoint_step"]
    print(f"wrote {args.out / ARTIFACT_MANIFEST} (checkpoint step {step})")
    return ExitCode.OK


def cmd_verify_export(args) -> int:
    from tpulab.inference.checkpoint_match import verification_table
    from tpulab.inference.trust import read_key, verify_export

    result = verify_export(args.artifacts, args.run_dir, read_key(args.key_file))
    print(verification_table(result))
    if not result["passed"]:
        failed = [r["artifact"] for r in result["rows"] if not r["passed"]]
        raise TpulabError(f"verification failed for {', '.join(failed)}", exit_code=ExitCode.FAILED)
    src = result["checkpoint_source"]
    print(
        f"all {len(result['rows'])} endpoints match checkpoint step {result['checkpoint_step']} "
        f"of {src['run_dir']} (run dir given by the {src['given_by']})"
    )
    return ExitCode.OK


def cmd_generate(args) -> int:
    from tpulab.inference.generate import generate_text
    from tpulab.model.sampling import SamplingConfig, prompt_ids

    _check_generate(args)
    cfg = SamplingConfig(
        max_new=args.max_new, temperature=args.temperature, top_k=args.top_k, seed=args.seed
    )
    if args.artifacts is not None:
        from tpulab.inference.trust import load_verified, read_key

        art = load_verified(args.artifacts, args.run_dir, read_key(args.key_file))
        print(f"artifacts {art.root}: verified ({art.verification['mode']})", file=sys.stderr)
        engine = art.engine(args.cache)
    else:
        from tpulab.model.decode import Decoder
        from tpulab.train.restore import load_model

        if args.key_file is not None:
            raise TpulabError(
                "--key-file applies to --artifacts (a checkpoint is verified by its own manifest)"
            )
        engine = Decoder.of(load_model(args.run_dir, args.step).model, args.cache)
    prompt_ids(args.prompt, engine.max_len, cfg.max_new)  # refuse bad input before writing anything
    sys.stdout.write(args.prompt)
    for piece in generate_text(engine, args.prompt, cfg):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return ExitCode.OK


def cmd_serve(args) -> int:
    from tpulab.inference.serve_stop import StopSignals

    stop = StopSignals(at_once=True).install()  # before the imports (seconds): a clean stop
    try:
        from tpulab.inference.config import ServeConfig
        from tpulab.ops.serving import serve

        args.cache_policy = tuple(args.cache_policy)  # nargs gives a list; the config a tuple
        cfg = from_flags(  # the time limits' flags are named without the unit
            ServeConfig,
            args,
            request_timeout_s="request_timeout",
            body_timeout_s="body_timeout",
            drain_timeout_s="drain_timeout",
            ready_timeout_s="ready_timeout",
            policies="cache_policy",
        )
        serve(
            artifacts=args.artifacts,
            model_uri=args.model,
            host=args.host,
            port=args.port,
            cfg=cfg,
            run_dir=args.run_dir,
            key_file=args.key_file,
            tracking_uri=args.tracking_uri,
            poll_interval_s=args.poll_interval,
            trace_log=args.trace_log,
            drift_reference=args.drift_reference,
            compile_cache_dir=args.compile_cache,
            stop=stop,
        )
    finally:
        stop.restore()
    return ExitCode.OK


def cmd_serve_bench(args) -> int:
    from tpulab.inference.serve_bench import BenchConfig, serve_bench

    cfg = BenchConfig(
        clients=tuple(args.clients),
        requests_per_client=args.requests,
        max_new=args.max_new,
        prompt=args.prompt,
        cache=args.cache,
        max_batch=args.max_batch,
        batch_window_ms=args.batch_window_ms,
    )
    serve_bench(args.artifacts, cfg, args.out)
    return ExitCode.OK


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"port {value} is not in 1..65535")
    return value


def register(sub) -> None:
    p = sub.add_parser(
        "kvcache", help="KV-cache precision table (fp32/bf16/int8) against the full forward"
    )
    p.add_argument("--run-dir", type=path_arg, required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest valid)")
    p.add_argument(
        "--out", type=path_arg, default=None, help="output dir (default: RUN_DIR/kvcache)"
    )
    p.set_defaults(handler=cmd_kvcache)

    p = sub.add_parser(
        "export", help="serialize prefill/decode endpoints (jax.export) for cpu, tpu and cuda"
    )
    p.add_argument("--run-dir", type=path_arg, required=True)
    p.add_argument("--out", type=path_arg, required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest valid)")
    p.add_argument("--batch", type=int, default=1, help="batch size the endpoints are lowered for")
    p.set_defaults(handler=cmd_export)

    p = sub.add_parser(
        "verify-export", help="check an artifact set's hashes and outputs against its checkpoint"
    )
    p.add_argument("artifacts", type=path_arg)
    p.add_argument(
        "--run-dir",
        type=path_arg,
        default=None,
        help="the checkpoint to check against (default: the run dir the manifest names); "
        "required with --key-file",
    )
    p.add_argument(
        "--key-file", type=path_arg, default=None, help="sign verification.json with this HMAC key"
    )
    p.set_defaults(handler=cmd_verify_export)

    p = sub.add_parser(
        "generate", help="stream text from a checkpoint or from verified exported endpoints"
    )
    p.add_argument(
        "--run-dir",
        type=path_arg,
        help="the checkpoint; with --artifacts: re-verify them against it",
    )
    p.add_argument("--artifacts", type=path_arg, help="verified artifacts (tpulab verify-export)")
    p.add_argument(
        "--key-file",
        type=path_arg,
        default=None,
        help="HMAC key verification.json must be signed with",
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step with --run-dir alone")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=_POLICIES, default="fp32")
    p.set_defaults(handler=cmd_generate)

    p = sub.add_parser(
        "serve",
        help="HTTP generation service over verified artifacts or a registered model version "
        "(FastAPI + uvicorn)",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--artifacts", type=path_arg, help="a verified export dir")
    which.add_argument(
        "--model",
        metavar="models:/NAME@ALIAS",
        help="a registry version: models:/NAME@ALIAS (followed while serving: a rollback is "
        "swapped in) or models:/NAME/VERSION",
    )
    p.add_argument(
        "--tracking-uri",
        help="the MLflow store of the model registry (with --model) and of the prompt registry "
        "that resolves a request's prompt_version (default with --model: $MLFLOW_TRACKING_URI, "
        "else sqlite:///<parent of --run-dir, else the current dir>/mlruns.db)",
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=10.0,
        help="with --model NAME@ALIAS: seconds between reads of the alias",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument(
        "--run-dir",
        type=path_arg,
        default=None,
        help="re-verify the artifacts against this checkpoint",
    )
    p.add_argument(
        "--key-file",
        type=path_arg,
        default=None,
        help="HMAC key verification.json must be signed with",
    )
    _batching_args(p)
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting beyond this get 503 + Retry-After",
    )
    p.add_argument(
        "--request-timeout", type=float, default=60.0, help="server-side limit per request (s)"
    )
    p.add_argument(
        "--body-timeout", type=float, default=10.0, help="time to send a request body (s): 408"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="after SIGTERM, how long requests in flight may take (s); then 503 and exit 0",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="still not ready (verified, compiled, probed) this long after start: exit 1 (s); "
        "a failed start exits 1 at once",
    )
    p.add_argument(
        "--trace-log",
        type=path_arg,
        default="serve_traces.jsonl",
        help="one JSON line per generate request (default: ./serve_traces.jsonl)",
    )
    p.add_argument(
        "--drift-reference",
        type=path_arg,
        default=None,
        help="text file or dir of *.txt the prompt drift statistic compares against (default: "
        "the training documents of the artifacts' run dir)",
    )
    p.add_argument(
        "--cache-policy",
        nargs="+",
        choices=_POLICIES,
        default=["fp32"],
        help="KV-cache policies served, the first ready first (default fp32 alone; each more "
        "is one compile per batch bucket)",
    )
    p.add_argument(
        "--compile-cache",
        type=path_arg,
        help="JAX persistent compilation cache dir, reused across starts (default: "
        "$TPULAB_COMPILE_CACHE, else ~/.cache/tpulab/jax-compile)",
    )
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser(
        "serve-bench", help="capacity table: the real service over loopback, 1/4/16 clients"
    )
    p.add_argument("--artifacts", type=path_arg, required=True)
    p.add_argument("--out", type=path_arg, required=True, help="writes OUT/serve_bench.{json,md}")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=8, help="requests per client")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--cache", choices=_POLICIES, default="fp32")
    _batching_args(p)
    p.set_defaults(handler=cmd_serve_bench)


def _batching_args(p) -> None:
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together, at most")
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=0.0,
        help="extra wait for more requests before a batch runs (requests arriving during a batch "
        "join the next one anyway)",
    )


def _check_generate(args) -> None:
    if args.artifacts is None and args.run_dir is None:
        raise TpulabError("generate needs --run-dir or --artifacts")
