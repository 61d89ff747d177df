"""Model operations: ``tpulab registry register|promote|rollback|retire|delete|status|prompt``."""

from __future__ import annotations

import sys

from tpulab.checkpoint.rundir import PROOF, VERDICT, read_json
from tpulab.cli.args import checked_path, path_arg
from tpulab.errors import ExitCode, TpulabError


def _open(args):
    from tpulab.ops.registry_store import open_registry, store_uri

    return open_registry(store_uri(args.tracking_uri))


def _compiles_cached() -> None:
    """Re-verification compiles every endpoint and the jitted model: with JAX's persistent cache
    (as ``train`` uses it) a second promotion loads them instead."""
    from tpulab import compile_cache

    compile_cache.enable()


def _err(line: str) -> None:
    print(line, file=sys.stderr)


def cmd_register(args) -> int:
    from tpulab.inference.artifact_format import ARTIFACT_MANIFEST
    from tpulab.ops.registry import register
    from tpulab.ops.registry_store import store_uri

    verdict = checked_path(args.resume_verdict, "--resume-verdict") if args.resume_verdict else None
    try:  # the trainer's store is beside the run dir the args.artifacts came from
        run_dir = read_json(args.artifacts / ARTIFACT_MANIFEST)["source"]["run_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        run_dir = None  # register() names the problem
    _compiles_cached()
    r = register(
        store_uri(args.tracking_uri, run_dir),
        args.artifacts,
        args.name,
        resume_verdict_path=verdict,
        reason=args.reason,
    )
    scores = "  ".join(f"{k}={v:.4f}" for k, v in r["evaluation"]["scores"].items())
    print(f"behaviour: {scores}")
    print(
        f"registered {r['name']} v{r['version']} in {r['store']} (ledger entry {r['entry']['seq']})"
    )
    return ExitCode.OK


def cmd_promote(args) -> int:
    from tpulab.ops.registry import promote

    reg = _open(args)
    _compiles_cached()
    r = promote(reg, args.name, args.version, args.to, reason=args.reason)
    was = f"v{r['from']}" if r["from"] else "none"
    print(f"{r['alias']}: {was} -> v{r['version']} (ledger entry {r['entry']['seq']})")
    return ExitCode.OK


def cmd_rollback(args) -> int:
    from tpulab.ops.registry import rollback

    reg = _open(args)
    _compiles_cached()
    r = rollback(reg, args.name, args.alias, reason=args.reason)
    if r["skipped"]:
        print(f"skipped {', '.join(r['skipped'])}")
    print(f"{r['alias']}: v{r['from']} -> v{r['version']}")
    return ExitCode.OK


def cmd_retire(args) -> int:
    from tpulab.ops.registry import retire

    r = retire(_open(args), args.name, args.version, reason=args.reason)
    print(f"retired {r['name']} v{r['version']} (ledger entry {r['entry']['seq']})")
    return ExitCode.OK


def cmd_delete(args) -> int:
    from tpulab.ops.registry import delete

    r = delete(_open(args), args.name, args.version, reason=args.reason)
    print(f"deleted {r['name']} v{r['version']} from the store (ledger entry {r['entry']['seq']})")
    return ExitCode.OK


def cmd_status(args) -> int:
    from tpulab.ops import tags as T
    from tpulab.ops.registry import status

    s = status(_open(args), args.name)
    print(f"model {s['name']} in {s['store']}")
    for alias, v in sorted(s["aliases"].items()):
        print(f"  {alias} -> v{v}")
    print("versions:")
    for row in s["versions"]:
        t = row["tags"]
        evals = " ".join(
            f"{k[len(T.EVAL_PREFIX) :]}={float(v):.4f}"
            for k, v in sorted(t.items())
            if k.startswith(T.EVAL_PREFIX)
        )
        flags = ", ".join(
            [*(f"@{a}" for a in row["aliases"]), *(["retired"] if row["retired"] else [])]
        )
        print(
            f"  v{row['version']}  manifest {t.get(T.EXPORT_MANIFEST, '?')[:12]} "
            f"(on disk: {row['manifest_on_disk']})  checkpoint {t.get(T.CHECKPOINT, '?')[:12]}"
            f"  {evals}{'  ' + flags if flags else ''}"
        )
    print(f"history ({s['ledger']}: {s['ledger_entries']} entries, chain intact):")
    for e in s["history"]:
        who = f"{e['who']['user']}@{e['who']['host']}"
        move = (
            f" {e['alias']}: {'v' + e['from_version'] if e.get('from_version') else 'none'} -> "
            f"v{e['version']}"
            if e.get("alias")
            else f" v{e['version']}"
        )
        print(f"  #{e['seq']} {e['time_utc']} {who} {e['action']}{move}: {e['reason']}")
    for d in s["drift"]:
        _err(f"warning: {d}")
    return ExitCode.FAILED if s["drift"] else ExitCode.OK


def cmd_prompt(args) -> int:
    from tpulab.ops.prompts import list_prompts, register_prompt

    reg = _open(args)
    if args.template is not None and args.template_file is not None:
        raise TpulabError("give --template or --template-file, not both")
    template = args.template
    if args.template_file is not None:
        path = checked_path(args.template_file, "--template-file")
        try:
            template = path.read_bytes().decode("utf-8")
        except OSError as e:
            raise TpulabError(f"cannot read {path} ({e.strerror})") from None
        except UnicodeDecodeError:
            raise TpulabError(f"{path} is not UTF-8 text") from None
    if template is None:
        versions = list_prompts(reg, args.name)
        if not versions:
            raise TpulabError(f"no prompt {args.name} in {reg.db}")
        for p in versions:
            print(f"{p.uri}  sha256 {p.sha256}  variables: {', '.join(p.variables) or '-'}")
        return ExitCode.OK
    p, created = register_prompt(reg, args.name, template, message=args.message)
    print(f"{p.uri}  sha256 {p.sha256}  ({'new version' if created else 'same text as before'})")
    return ExitCode.OK


def register(sub) -> None:
    p = sub.add_parser(
        "registry",
        help="model registry on the MLflow store: register, promote, rollback, retire, status",
        description="Versions of verified export sets in the MLflow Model Registry of the "
        "project's store, aliases moved only on evidence, every move in a hash-chained ledger.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name, help, handler):
        q = actions.add_parser(name, help=help)
        q.add_argument(
            "--tracking-uri",
            help="the MLflow store (default: $MLFLOW_TRACKING_URI, else ./mlruns.db; register: "
            "mlruns.db beside the artifacts' run dir, where the trainer logs)",
        )
        q.set_defaults(handler=handler)
        return q

    def reason(q):
        q.add_argument("--reason", help="why, for the ledger (default: names the evidence)")

    q = action("register", "a new version from verified export artifacts", cmd_register)
    q.add_argument("--artifacts", type=path_arg, required=True)
    q.add_argument("--name", required=True)
    q.add_argument(
        "--resume-verdict",
        type=path_arg,
        help=f"the kill/resume {VERDICT} of the training run (default: ../{PROOF}/{VERDICT} "
        "beside the run dir, when it is about this run)",
    )
    reason(q)

    q = action("promote", "move an alias to a version: re-verify, re-evaluate, gate", cmd_promote)
    q.add_argument("name")
    q.add_argument("version", type=int)
    q.add_argument("--to", default="champion", help="the alias (default: champion)")
    reason(q)

    q = action("rollback", "move an alias back to the version promoted before", cmd_rollback)
    q.add_argument("name")
    q.add_argument("--alias", default="champion")
    reason(q)

    q = action("retire", "make a version unservable (refused while it holds an alias)", cmd_retire)
    q.add_argument("name")
    q.add_argument("version", type=int)
    reason(q)

    q = action("delete", "delete a version from the store (refused while aliased)", cmd_delete)
    q.add_argument("name")
    q.add_argument("version", type=int)
    reason(q)

    q = action(
        "status", "aliases, versions, ledger history; exit 1 on store/ledger drift", cmd_status
    )
    q.add_argument("name")

    q = action(
        "prompt", "register a prompt template (by content hash), or list versions", cmd_prompt
    )
    q.add_argument("name")
    q.add_argument("--template", help="the template text ({{ variable }} placeholders)")
    q.add_argument("--template-file", type=path_arg, help="read the template from this UTF-8 file")
    q.add_argument("--message", help="commit message stored with a new version")
