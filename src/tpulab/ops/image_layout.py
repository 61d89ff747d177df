"""The OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/*``): written and checked.

``write_documents`` writes the image config, the manifest and the index over layer blobs already
in ``blobs/sha256`` (JSON with sorted keys, blobs named by their sha256). ``verify_layout`` is the
one check that ``tpulab image verify`` and ``tpulab image run`` share: every blob is rehashed
against its digest and size, every layer's uncompressed diff_id against the config, and
``index.json``, the one file no digest covers, must be byte for byte the index that
``write_documents`` makes of the verified manifest and config. So a flipped byte anywhere is
refused in one line naming the blob, its kind and digest; the one exception is a flip inside the
tag that leaves a valid tag (it renames the image and changes nothing it runs).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import platform
import re
from pathlib import Path

from tpulab.errors import TpulabError
from tpulab.ops.image_layers import CHUNK

INDEX_MEDIA = "application/vnd.oci.image.index.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar+gzip"
REF_NAME = "org.opencontainers.image.ref.name"
TITLE = "org.opencontainers.image.title"
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
CREATED = "1970-01-01T00:00:00Z"
INDEX = "index.json"
MARKER = "oci-layout"


def arch() -> str:
    """This host's architecture in OCI's words (the image holds this host's interpreter)."""
    m = platform.machine().lower()
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(m, m)


def _blob(directory: Path, obj: dict, media: str) -> dict:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(data).hexdigest()
    (directory / digest).write_bytes(data)
    return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}


def index_bytes(manifest_desc: dict, platform_: dict, tag: str) -> bytes:
    """``index.json`` for one manifest: what the writer writes and the verifier expects."""
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA,
        "manifests": [{**manifest_desc, "platform": platform_, "annotations": {REF_NAME: tag}}],
    }
    return json.dumps(index, sort_keys=True, indent=1).encode()


def write_documents(
    root: Path, written: list[dict], process: dict, *, tag: str, title: str
) -> tuple[dict, dict]:
    """Write the config (``process``: its ``config`` section), manifest, index and layout marker
    into ``root`` over the layers ``written`` (``write_layer``'s results, in order); returns the
    config's and the manifest's descriptors."""
    blobs = root / "blobs" / "sha256"
    config = {
        "architecture": arch(),
        "os": "linux",
        "created": CREATED,
        "config": process,
        "rootfs": {"type": "layers", "diff_ids": [w["diff_id"] for w in written]},
        "history": [
            {"created": CREATED, "created_by": f"tpulab image build: {w['name']}"} for w in written
        ],
    }
    config_desc = _blob(blobs, config, CONFIG_MEDIA)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA,
        "config": config_desc,
        "layers": [
            {"mediaType": LAYER_MEDIA, "digest": w["digest"], "size": w["size"]} for w in written
        ],
        "annotations": {TITLE: title},
    }
    manifest_desc = _blob(blobs, manifest, MANIFEST_MEDIA)
    platform_ = {"architecture": config["architecture"], "os": config["os"]}
    (root / INDEX).write_bytes(index_bytes(manifest_desc, platform_, tag))
    (root / MARKER).write_bytes(b'{"imageLayoutVersion":"1.0.0"}')
    return config_desc, manifest_desc


# --- checking -----------------------------------------------------------------------------------


def _check_blob(layout: Path, desc: dict, kind: str, referrer: str) -> Path:
    """The blob of ``desc`` after checking its sha256 and size (streamed: layers are 100s of MB)."""
    digest = desc.get("digest") if isinstance(desc, dict) else None
    algo, _, hexd = str(digest).partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexd):
        raise TpulabError(f"{layout}: {referrer} names a {kind} blob by a bad digest {digest!r}")
    path = layout / "blobs" / "sha256" / hexd
    if not path.is_file():
        raise TpulabError(f"{layout}: {kind} blob {digest} (named by {referrer}) is missing")
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    if f"sha256:{h.hexdigest()}" != digest or size != desc.get("size"):
        raise TpulabError(
            f"{layout}: {kind} blob {digest} does not match its digest or size in {referrer}"
        )
    return path


def _json_blob(layout: Path, desc: dict, kind: str, referrer: str) -> dict:
    try:
        return json.loads(_check_blob(layout, desc, kind, referrer).read_bytes())
    except ValueError:
        raise TpulabError(f"{layout}: {kind} blob {desc['digest']} is not JSON") from None


def _diff_id(layout: Path, desc: dict, referrer: str) -> tuple[str, int]:
    """The sha256 and size of a layer blob's uncompressed tar (the blob itself checked first)."""
    h, raw = hashlib.sha256(), 0
    try:
        with gzip.open(_check_blob(layout, desc, "layer", referrer), "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                raw += len(chunk)
    except (OSError, EOFError):
        raise TpulabError(f"{layout}: layer blob {desc['digest']} is not gzip") from None
    return f"sha256:{h.hexdigest()}", raw


def verify_layout(layout: str | Path) -> dict:
    """Rehash everything an image layout holds (see the module docstring); returns the manifest
    digest, each blob's size (a layer's uncompressed) and the verified image config."""
    layout = Path(layout)
    try:
        marker = json.loads((layout / MARKER).read_text())
    except OSError:
        raise TpulabError(f"{layout} is not an OCI image layout (no {MARKER})") from None
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or marker.get("imageLayoutVersion") != "1.0.0":
        raise TpulabError(f"{layout}: {MARKER} does not mark an OCI 1.0.0 layout")
    try:
        raw_index = (layout / INDEX).read_bytes()
    except OSError:
        raise TpulabError(f"{layout} is not an OCI image layout (no {INDEX})") from None
    try:
        (mdesc,) = json.loads(raw_index)["manifests"]
        tag = mdesc["annotations"][REF_NAME]
    except (ValueError, KeyError, TypeError):
        raise TpulabError(
            f"{layout}: index {INDEX} is not an index of one tagged manifest"
        ) from None
    manifest = _json_blob(layout, mdesc, "manifest", INDEX)
    named_by = f"manifest {mdesc['digest']}"
    try:
        config = _json_blob(layout, manifest["config"], "config", named_by)
        layers, diff_ids = manifest["layers"], config["rootfs"]["diff_ids"]
        platform_ = {"architecture": config["architecture"], "os": config["os"]}
    except (KeyError, TypeError):
        raise TpulabError(f"{layout}: the manifest or config lacks required fields") from None
    desc = {"mediaType": MANIFEST_MEDIA, "digest": mdesc["digest"], "size": mdesc["size"]}
    if not (isinstance(tag, str) and TAG.fullmatch(tag)) or raw_index != index_bytes(
        desc, platform_, tag
    ):
        raise TpulabError(
            f"{layout}: index {INDEX} is not the index of manifest {mdesc['digest']} "
            f"(tag {tag!r}) as tpulab writes it"
        )
    if len(diff_ids) != len(layers):
        raise TpulabError(f"{layout}: {len(layers)} layers, {len(diff_ids)} diff_ids")
    blobs = {mdesc["digest"]: mdesc["size"], manifest["config"]["digest"]: 0}
    for i, (layer, diff) in enumerate(zip(layers, diff_ids)):
        got, raw = _diff_id(layout, layer, named_by)
        if got != diff:
            raise TpulabError(
                f"{layout}: layer blob {layer['digest']} (layer {i + 1} of {len(layers)}) "
                f"does not unpack to its diff_id {diff}"
            )
        blobs[layer["digest"]] = raw
    blobs[manifest["config"]["digest"]] = manifest["config"]["size"]
    return {"manifest_digest": mdesc["digest"], "tag": tag, "blobs": blobs, "config": config}
