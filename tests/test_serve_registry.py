"""Serving from the MLflow Model Registry: resolution and refusals before listening, tags checked
against the files, and a rollback picked up by a running service (real processes, real HTTP).

Most versions and aliases are made here with the MLflow client, following the registry contract
(``tpulab.ops.tags``), to stand for moves made outside tpulab; the running-service test promotes
and rolls back with the real ``tpulab registry`` CLI.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time

import httpx
import pytest

from test_serve import free_port, reap, start_server, verified_export, wait_ready
from tpulab.errors import TpulabError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def art40(trained_run, tmp_path_factory):
    return verified_export(trained_run, tmp_path_factory, 40)


@pytest.fixture(scope="module")
def art20(trained_run, tmp_path_factory):
    """Step 20: worse than step 40 on the behaviour suite, so 20 -> 40 passes promote's gate."""
    return verified_export(trained_run, tmp_path_factory, 20)


def _tags(art, **forged) -> dict:
    from tpulab.checkpoint.files import sha256_file
    from tpulab.inference.artifacts import open_artifacts
    from tpulab.ops import tags as T

    m = open_artifacts(art).manifest
    tags = {
        T.ARTIFACTS: str(art.resolve()),
        T.EXPORT_MANIFEST: sha256_file(art / "manifest.json"),
        T.CHECKPOINT: m["source"]["checkpoint_manifest_sha256"],
        T.CORPUS: "test",
        T.RUN_ID: "",
        T.RESUME_VERDICT: "absent",
    }
    return {**tags, **forged}


def _register(client, name, art, **tags) -> str:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException:
        pass  # exists
    source = str(art.resolve())
    return str(client.create_model_version(name, source=source, tags=_tags(art, **tags)).version)


@pytest.fixture
def store(tmp_path):
    from mlflow.tracking import MlflowClient

    from tpulab.tracking.store import open_store, sqlite_uri

    uri = sqlite_uri(tmp_path / "mlruns.db")
    open_store(uri)  # a store as the trainer makes it
    return uri, MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_model_uris_parse_or_are_one_line_errors():
    from tpulab.ops.serving import ModelRef

    assert ModelRef.parse("models:/tiny@champion") == ModelRef("tiny", "champion", None)
    assert ModelRef.parse("models:/tiny/3") == ModelRef("tiny", None, "3")
    assert str(ModelRef.parse("models:/a.b-c@x_1")) == "models:/a.b-c@x_1"
    for bad in ("tiny@champion", "models:/tiny", "models:/tiny/0", "models:/@x", "models:/t@"):
        with pytest.raises(TpulabError, match="is not models:/NAME@ALIAS"):
            ModelRef.parse(bad)


def test_a_missing_store_is_refused_and_not_created(tmp_path):
    from tpulab.ops.registry_store import open_registry

    with pytest.raises(TpulabError, match="no registry store at"):
        open_registry(f"sqlite:///{tmp_path}/none/mlruns.db")
    with pytest.raises(TpulabError, match="no registry store at"):
        open_registry(f"sqlite:///{tmp_path}/mlruns.db")
    assert list(tmp_path.iterdir()) == []


def test_resolution_refusals(store, art40):
    from tpulab.ops import tags as T
    from tpulab.ops.registry_store import open_registry
    from tpulab.ops.serving import ModelRef, check_servable, resolve

    uri, client = store
    v1 = _register(client, "tiny", art40)
    v2 = _register(client, "tiny", art40, **{T.RETIRED: "true"})
    v3 = _register(client, "tiny", art40, **{T.ARTIFACTS: "/elsewhere"})
    v4 = _register(client, "tiny", art40, **{T.EXPORT_MANIFEST: ""})
    for alias, v in (("champion", v1), ("old", v2), ("moved", v3), ("bare", v4)):
        client.set_registered_model_alias("tiny", alias, v)
    reg = open_registry(uri)
    check_servable(resolve(reg, ModelRef("tiny", "champion")))  # the good one passes
    cases = {
        ModelRef("tiny", "old"): "tiny version 2 (@old) is retired",
        ModelRef("tiny", "moved"): "is not the absolute path its tag tpulab.artifacts names",
        ModelRef("tiny", "bare"): "has no tag tpulab.export_manifest_sha256",
        ModelRef("tiny", None, "9"): "model tiny has no version 9 in",
        ModelRef("tiny", "nope"): "model tiny has no alias nope in",
        ModelRef("other", "champion"): "no model other in",
    }
    for ref, reason in cases.items():
        with pytest.raises(TpulabError, match=re.escape(reason)) as e:
            check_servable(resolve(reg, ref))
        assert "\n" not in str(e.value)


def test_tags_are_checked_against_the_verified_files(store, art40, art20):
    """A version whose digest tags name other artifacts than its source holds is refused after
    verification (the tags are claims); with honest tags it loads, its identity from the files."""
    from tpulab.checkpoint.files import sha256_file
    from tpulab.ops import tags as T
    from tpulab.ops.registry_store import open_registry
    from tpulab.ops.serving import ModelRef, load_registered, resolve

    uri, client = store
    other = _tags(art20)
    honest = _register(client, "tiny", art40)
    forged_manifest = _register(
        client, "tiny", art40, **{T.EXPORT_MANIFEST: other[T.EXPORT_MANIFEST]}
    )
    forged_ckpt = _register(client, "tiny", art40, **{T.CHECKPOINT: other[T.CHECKPOINT]})
    reg = open_registry(uri)
    model = load_registered(resolve(reg, ModelRef("tiny", None, honest)))
    assert model.identity()["version"] == honest
    assert model.identity()["manifest_sha256"] == sha256_file(art40 / "manifest.json")
    assert model.registry["tags_checked"] == sorted([T.CHECKPOINT, T.EXPORT_MANIFEST])
    for v, tag in ((forged_manifest, T.EXPORT_MANIFEST), (forged_ckpt, T.CHECKPOINT)):
        with pytest.raises(TpulabError, match=f"tag {tag}=.* but the verified artifacts"):
            load_registered(resolve(reg, ModelRef("tiny", None, v)))


def test_serve_refuses_a_retired_version_before_listening(store, art40, tmp_path):
    from tpulab.ops import tags as T

    uri, client = store
    v = _register(client, "tiny", art40, **{T.RETIRED: "true"})
    client.set_registered_model_alias("tiny", "champion", v)
    port = free_port()
    with open(tmp_path / "retired.log", "wb") as log:
        proc = start_server(
            log, "--model", "models:/tiny@champion", "--tracking-uri", uri, port=port
        )
        try:
            rc = proc.wait(timeout=120)
        finally:
            reap(proc)
    out = (tmp_path / "retired.log").read_text().strip()
    assert rc == 2 and out == "error: tiny version 1 (@champion) is retired; it is not served", out


def test_serve_model_stops_cleanly_while_resolving_and_once_ready(store, art40, tmp_path):
    """``serve --model models:/NAME@ALIAS``: SIGTERM or SIGINT at a seeded moment in the first 3 s
    after the process catches the signals (the registry read and JAX's import run in the main
    thread then: the latch stops the server as soon as it runs), and once ready: exit 0 within the
    4 s drain bound, no abort, traceback or process left."""
    import random
    import signal

    from test_serve_ready import _signal_at, catching_sigterm, stop_problems

    uri, client = store
    client.set_registered_model_alias("tiny", "champion", _register(client, "tiny", art40))
    rng = random.Random(4)
    for when in ("early", "ready"):
        sig = rng.choice([signal.SIGTERM, signal.SIGINT])
        port, log_path = free_port(), tmp_path / f"{when}.log"
        with open(log_path, "wb") as log:
            proc = start_server(
                log,
                *("--model", "models:/tiny@champion", "--tracking-uri", uri),
                *("--drain-timeout", "4"),
                port=port,
                max_batch=1,
            )
            try:
                catching_sigterm(proc)
                delay = rng.uniform(0.0, 3.0)
                if when == "ready":
                    wait_ready(proc, f"http://127.0.0.1:{port}", log_path)
                    delay = 0.0
                rc, took, _, out = _signal_at(proc, log_path, sig, delay, 4.0)
            finally:
                reap(proc)
        assert stop_problems(rc, took, 4.0, out, proc.pid) == [], (when, rc, took, out)
        assert "stopped" in out, out


def test_promotion_and_rollback_are_picked_up_by_a_running_service(
    registry_flow, art40, art20, tmp_path
):
    """A server follows champion on a copy of the suite's registry flow (v1 = step 20, v2 = step
    40, champion promoted v1 then v2 by ``tpulab registry``: ``conftest.registry_flow``), while
    ``tpulab registry rollback`` moves it back to v1 and ``tpulab registry promote`` forward to v2
    again (the CLI's ``main``, in this process; the registry CLI as its own process, exit codes and
    output, is test_registry.py's ``test_the_cli_process_prints_one_line_and_no_mlflow_chatter``):
    it hot-swaps on each move, two clients see no error and each sees 2, then 1, then 2 again,
    /v1/model reports the old digest after the rollback; a forged and a retired version moved
    onto the alias outside tpulab are refused while 2 serves on. The same server resolves a
    request's ``prompt_version`` against the prompt registry of its store."""
    from conftest import copy_registry_store
    from test_registry import registry
    from test_serve import _traces
    from tpulab.checkpoint.files import sha256_file
    from tpulab.ops import tags as T
    from tpulab.ops.prompts import prompt_sha256
    from tpulab.tracking.store import sqlite_uri

    copy_registry_store(registry_flow[0], tmp_path)  # the store and its ledger
    uri = sqlite_uri(tmp_path / "mlruns.db")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    digest = {"1": sha256_file(art20 / "manifest.json"), "2": sha256_file(art40 / "manifest.json")}
    assert client.get_registered_model("tiny").aliases == {"champion": 2}
    template = "{{ speaker }}:"
    rc, _, err = registry(uri, "prompt", "speaker", "--template", template)
    assert rc == 0, err
    client.set_prompt_alias("speaker", "prod", 1)
    port, log_path = free_port(), tmp_path / "rollback.log"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = start_server(
            log,
            *("--model", "models:/tiny@champion", "--tracking-uri", uri),
            *("--poll-interval", "0.5"),
            port=port,
            max_batch=1,  # one bucket: 3 compiles per version, not 9
        )
        try:
            wait_ready(proc, base, log_path)
            seen, stop = [[] for _ in range(2)], threading.Event()

            def client_loop(out):
                # Paced (10 requests/s each at most), not back to back: a saturated server starved
                # the registry CLI of CPU here (promote 143 s, rollback 131 s at load 20).
                with httpx.Client(timeout=60) as c:
                    while not stop.wait(0.1):
                        r = c.post(f"{base}/v1/generate", json={"prompt": "To", "max_new": 4})
                        out.append((time.monotonic(), r.status_code, r.json()))

            def identity():
                return httpx.get(f"{base}/v1/model", timeout=10).json()

            def every_client_saw(version):
                deadline = time.monotonic() + 60
                while not all(o and o[-1][2].get("model", {}).get("version") == version
                              for o in seen):  # fmt: skip
                    assert time.monotonic() < deadline and proc.poll() is None, version
                    time.sleep(0.05)

            def cli_and_wait(version, *args):
                """The registry command (the CLI's ``main`` here), then wait for the server."""
                t0 = time.monotonic()
                rc, stdout, stderr = registry(uri, *args)
                assert rc == 0, stderr
                cli_s = time.monotonic() - t0
                while identity()["identity"]["version"] != version:
                    assert time.monotonic() - t0 < 300 and proc.poll() is None
                    time.sleep(0.1)
                every_client_saw(version)
                return stdout, cli_s, time.monotonic() - t0

            def ask(prompt, label):
                body = {"prompt": prompt, "max_new": 2, "prompt_version": label}
                return httpx.post(f"{base}/v1/generate", json=body, timeout=60)

            assert identity()["identity"]["version"] == "2"
            prompted = {
                "alias": ask("ROMEO:", "prompts:/speaker@prod"),
                "version": ask("JULIET:", "speaker/1"),
                "unknown": ask("ROMEO:", "speaker/9"),
                "no_alias": ask("ROMEO:", "speaker@staging"),
                "other_text": ask("To be", "prompts:/speaker/1"),
            }
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                clients = [pool.submit(client_loop, out) for out in seen]
                every_client_saw("2")
                rolled, rollback_cli_s, rollback_s = cli_and_wait(
                    "1", "rollback", "tiny", "--reason", "v2 misbehaves"
                )
                after_rollback = identity()
                promoted, promote_cli_s, promote_s = cli_and_wait("2", "promote", "tiny", "2")
                stop.set()
                [f.result() for f in clients]
            after = identity()
            # A forged digest tag and a retired version, moved onto the alias outside tpulab (the
            # MLflow client): refused by the server, version 2 keeps serving.
            forged = _register(client, "tiny", art40, **{T.EXPORT_MANIFEST: digest["1"]})
            client.set_registered_model_alias("tiny", "champion", forged)
            deadline = time.monotonic() + 120
            while (identity()["watch"]["refused"] or {}).get("version") != forged:
                assert time.monotonic() < deadline, identity()["watch"]
                time.sleep(0.1)
            refused_forged = identity()
            retired = _register(client, "tiny", art40, **{T.RETIRED: "true"})
            client.set_registered_model_alias("tiny", "champion", retired)
            deadline = time.monotonic() + 60
            while (identity()["watch"]["refused"] or {}).get("version") != retired:
                assert time.monotonic() < deadline, identity()["watch"]
                time.sleep(0.1)
            refused_retired = identity()
            still = httpx.post(f"{base}/v1/generate", json={"prompt": "To", "max_new": 2}).json()
        finally:
            reap(proc)
    print(
        f"CLI start -> /v1/model reports it: rollback {rollback_s:.2f} s (CLI {rollback_cli_s:.2f}"
        f" s), promotion {promote_s:.2f} s (CLI {promote_cli_s:.2f} s), poll 0.5 s"
    )
    assert "champion: v2 -> v1" in rolled and "champion: v1 -> v2" in promoted
    ledger = [json.loads(x) for x in (tmp_path / "registry_ledger.jsonl").read_text().splitlines()]
    assert [(e["action"], e["version"]) for e in ledger] == [
        ("register", "1"),
        ("register", "2"),
        ("promote", "1"),
        ("promote", "2"),
        ("rollback", "1"),
        ("promote", "2"),
    ]
    assert after_rollback["manifest_sha256"] == digest["1"]
    assert after_rollback["registry"]["version"] == "1"
    assert after["manifest_sha256"] == digest["2"] and after["registry"]["version"] == "2"
    assert [(s["from"]["version"], s["to"]["version"]) for s in after["swaps"]] == [
        ("2", "1"),
        ("1", "2"),
    ]
    for out in seen:
        assert out and all(code == 200 for _, code, _ in out), out[-3:]
        versions = [b["model"]["version"] for _, _, b in out]
        assert all(b["model"]["manifest_sha256"] == digest[b["model"]["version"]] for *_, b in out)
        changes = [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
        assert changes == ["2", "1", "2"], changes  # each client: new, then old, then new again
    assert "but the verified artifacts" in refused_forged["watch"]["refused"]["why"]
    assert refused_forged["identity"]["version"] == "2"
    assert "is retired" in refused_retired["watch"]["refused"]["why"]
    assert still["model"]["version"] == "2" and still["manifest_sha256"] == digest["2"]
    assert "Traceback" not in log_path.read_text()

    # prompt_version: the version the registry holds (an alias resolved to its number), the
    # template's hash; an unknown version or alias, or a prompt not rendered from the template,
    # is refused and traced without a version.
    traces = _traces(log_path)
    for kind in ("alias", "version"):
        r = prompted[kind]
        assert r.status_code == 200, r.text
        t = traces[r.json()["request_id"]]
        assert r.json()["prompt_version"] == t["prompt_version"] == "prompts:/speaker/1"
        assert t["prompt_resolved"] is True and r.json()["prompt_resolved"] is True
        assert t["prompt_template_sha256"] == prompt_sha256(template)
    assert traces[prompted["alias"].json()["request_id"]]["prompt_label"] == "prompts:/speaker@prod"
    refusals = {
        "unknown": "no prompt speaker version 9 in the registry",
        "no_alias": "no prompt speaker alias staging in the registry",
        "other_text": "the prompt is not prompts:/speaker/1 rendered",
    }
    for kind, words in refusals.items():
        r = prompted[kind]
        assert r.status_code == 422 and words in r.json()["detail"], r.text
        t = traces[r.json()["request_id"]]
        assert t["status"] == 422 and t["prompt_version"] is None and not t["prompt_resolved"]
        assert t["prompt_label"] == json.loads(r.request.content)["prompt_version"]


def test_the_watcher_swaps_refuses_once_and_retries_after_the_alias_moves(store, art40):
    """``AliasWatcher.poll`` on a real store, with a stand-in load: a refused version is not
    reloaded on every poll, but is tried again once the alias has named another version."""
    from types import SimpleNamespace

    from tpulab.ops.registry_store import open_registry
    from tpulab.ops.serving import AliasWatcher, ModelRef, resolve

    uri, client = store
    for _ in range(3):
        _register(client, "tiny", art40)
    client.set_registered_model_alias("tiny", "champion", "1")
    registry = open_registry(uri)
    loads, swaps, broken = [], [], {"2"}

    def load(reg):
        loads.append(reg.version)
        if reg.version in broken:
            raise TpulabError(f"version {reg.version} is broken")
        return SimpleNamespace(art=SimpleNamespace(manifest_sha256=reg.version * 64))

    service = SimpleNamespace(
        notes={},
        on_close=[],
        prepare=lambda model: model,
        swap=lambda model, why: swaps.append(model.art.manifest_sha256[0]) or {},
    )
    serving = resolve(registry, ModelRef("tiny", "champion"))
    watcher = AliasWatcher(service, registry, serving, 1.0, load)
    assert watcher.poll() == "unchanged" and loads == []
    client.set_registered_model_alias("tiny", "champion", "2")
    assert watcher.poll() == watcher.poll() == "refused: version 2 is broken" and loads == ["2"]
    assert service.notes["watch"]["refused"] == {"version": "2", "why": "version 2 is broken"}
    client.set_registered_model_alias("tiny", "champion", "3")
    assert watcher.poll() == "swapped to 3" and swaps == ["3"]
    broken.clear()
    client.set_registered_model_alias("tiny", "champion", "2")
    assert watcher.poll() == "swapped to 2" and swaps == ["3", "2"] and loads == ["2", "3", "2"]
    assert service.notes["watch"]["refused"] is None and service.notes["watch"]["polls"] == 5


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--model", "tiny@champion"], "is not models:/NAME@ALIAS"),
        (["--model", "models:/tiny@champion", "--tracking-uri", "sqlite:////nonexistent/m.db"],
         "no registry store at /nonexistent/m.db"),
        (["--artifacts", "{art}", "--drain-timeout", "0.5"], "drain_timeout=0.5 must be in (1"),
        (["--artifacts", "{art}", "--ready-timeout", "nan"], "ready_timeout=nan"),
        (["--artifacts", "{art}", "--body-timeout", "0"], "body_timeout=0"),
        (["--artifacts", "{art}", "--poll-interval", "0"], "poll_interval=0"),
        (["--artifacts", "{art}", "--trace-log", "/proc/self/no/t.jsonl"], "trace log /proc/self"),
        (["--artifacts", "{tmp}"], "no manifest.json"),
        (["--artifacts", "{art}", "--drift-reference", "{tmp}/none"], "corpus not found"),
    ],
)  # fmt: skip
def test_serve_flags_are_one_line_errors_before_listening(args, reason, art40, tmp_path, capsys):
    from tpulab.cli.main import main

    args = [a.format(art=art40, tmp=tmp_path) for a in args]
    rc = main(["serve", *args, "--port", str(free_port())])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and reason in err, err
