"""Operations subcommands: data contracts, the container image, the capacity model."""

from __future__ import annotations

import argparse
import json

from tpulab.cli.args import checked_path, path_arg
from tpulab.errors import ExitCode


def cmd_contract_record(args) -> int:
    from tpulab.checkpoint.files import atomic_write_bytes, check_out
    from tpulab.data import contract
    from tpulab.data.corpus import load_corpus
    from tpulab.errors import TpulabError

    checked_path(args.data, "--data")  # "" would silently mean the current directory
    check_out(args.out, file=True)  # before reading the corpus: a contract is never overwritten
    if not args.out.parent.is_dir():
        raise TpulabError(f"directory {args.out.parent} does not exist")
    c = contract.record(load_corpus(args.data), args.size_tolerance, args.entropy_tolerance)
    atomic_write_bytes(args.out, contract.dumps(c))
    r = c.recorded_from
    print(
        f"recorded {args.out}: {c.documents} documents, {len(c.byte_values)} byte values, "
        f"{r['total_bytes']} bytes, entropy {r['entropy_bits_per_byte']:.4f} bits/byte "
        f"(band {c.entropy_bits_per_byte[0]:.4f}..{c.entropy_bits_per_byte[1]:.4f})"
    )
    return ExitCode.OK


def cmd_contract_check(args) -> int:
    from tpulab.data import contract
    from tpulab.data.corpus import load_corpus
    from tpulab.errors import TpulabError

    for value, flag in ((args.data, "--data"), (args.contract, "--contract")):
        if value is not None:
            checked_path(value, flag)
    corpus = load_corpus(args.data)
    if args.contract is not None:
        found = contract.load(args.contract), f"data contract {args.contract}"
    elif args.data is None:
        found = contract.shipped()
    else:
        raise TpulabError("--contract is required for a corpus other than the shipped one")
    s = contract.check(corpus, *found)
    print(
        f"corpus {corpus.source} honours {found[1]}: {s.documents} documents, "
        f"{s.total_bytes} bytes, entropy {s.entropy_bits_per_byte:.4f} bits/byte"
    )
    return ExitCode.OK


def cmd_image_build(args) -> int:
    from tpulab.ops.image_build import build_image

    r = build_image(args.artifacts, args.out, tag=args.tag, key_file=args.key_file)
    print(json.dumps(r["summary"], indent=1) if args.json else r["line"])
    return ExitCode.OK


def cmd_image_verify(args) -> int:
    from tpulab.ops.image_layout import verify_layout

    r = verify_layout(args.layout)
    print(
        f"{args.layout}: {len(r['blobs'])} blobs match their digests; "
        f"manifest {r['manifest_digest']}"
    )
    return ExitCode.OK


def cmd_image_run(args) -> int:
    from tpulab.ops.image_run import run_image

    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    return run_image(args.layout, args.rootfs, extra or None)  # the image process's exit code


def cmd_capacity(args) -> int:
    from tpulab.ops.capacity import plan, plan_text

    print(plan_text(plan(args.table, args.p99_ms, args.load, args.headroom, server=args.server)))
    return ExitCode.OK


def register(sub) -> None:
    p = sub.add_parser("contract", help="data contracts: record one for a corpus, check a corpus")
    csub = p.add_subparsers(dest="contract_command", required=True, metavar="ACTION")
    r = csub.add_parser("record", help="write the contract a corpus defines (its bands)")
    r.add_argument("--data", required=True, help="text file or directory of *.txt")
    r.add_argument("--out", type=path_arg, required=True, help="contract JSON to write (new file)")
    r.add_argument("--size-tolerance", type=float, default=0.05, help="relative size band")
    r.add_argument("--entropy-tolerance", type=float, default=0.02, help="bits/byte either side")
    r.set_defaults(handler=cmd_contract_record)
    c = csub.add_parser("check", help="check a corpus against a contract (what train does)")
    c.add_argument("--data", help="text file or directory of *.txt (default: the shipped corpus)")
    c.add_argument("--contract", help="contract JSON (default: the shipped corpus's)")
    c.set_defaults(handler=cmd_contract_check)

    p = sub.add_parser("image", help="OCI image of the service, built without a daemon")
    isub = p.add_subparsers(dest="image_command", required=True, metavar="ACTION")
    b = isub.add_parser("build", help="write an OCI image layout from verified artifacts")
    b.add_argument("--artifacts", required=True, help="verified export dir (tpulab verify-export)")
    b.add_argument("--out", type=path_arg, required=True, help="OCI layout dir (new or empty)")
    b.add_argument("--tag", default="latest", help="the image's ref name in index.json")
    b.add_argument("--key-file", help="HMAC key the verification record must be signed with")
    b.add_argument("--json", action="store_true", help="print the build summary as JSON")
    b.set_defaults(handler=cmd_image_build)
    v = isub.add_parser("verify", help="rehash every blob of an OCI layout against its digest")
    v.add_argument("layout", help="OCI layout dir")
    v.set_defaults(handler=cmd_image_verify)
    r = isub.add_parser(
        "run", help="run an unpacked image under bubblewrap (no daemon), host network"
    )
    r.add_argument("--layout", required=True, help="OCI layout (its config: entrypoint, env, user)")
    r.add_argument("--rootfs", required=True, help="the layout unpacked (umoci raw unpack)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="-- ARGS: replace the image's Cmd")
    r.set_defaults(handler=cmd_image_run)

    p = sub.add_parser("capacity", help="replicas for a load at a p99 target, from serve-bench")
    p.add_argument("--table", required=True, help="serve_bench.json or capacity.json")
    p.add_argument("--p99-ms", type=float, required=True, help="p99 latency target (ms)")
    p.add_argument("--load", type=float, required=True, help="offered load (requests/s)")
    p.add_argument("--headroom", type=float, default=0.3, help="fraction of capacity kept free")
    p.add_argument("--server", default="batching", help="which server's rows (prefix match)")
    p.set_defaults(handler=cmd_capacity)
