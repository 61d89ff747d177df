"""Generation prompt templates versioned by content hash, kept in MLflow's prompt registry.

Why MLflow's registry: it runs offline on the same sqlite store as the models (mlflow-skinny
3.17.2), numbers immutable versions and names them ``prompts:/NAME/N``, which MLflow tracing can
link to a trace. What it lacks, added here: content identity (registering the same text twice makes
two versions there; here it returns the first) and a check that a stored template is what was
registered: every version carries ``PROMPT_SHA256`` (sha256 of the template's UTF-8 bytes), and
``load_prompt`` recomputes it and refuses a mismatch. Templates use MLflow's ``{{ name }}``
placeholders; ``Prompt.render`` fills them strictly (a missing or unknown variable is an error).

Serving: a request's ``prompt_version`` (``prompts:/NAME/N``, ``prompts:/NAME@ALIAS``, or the same
without ``prompts:/``) is a claim. ``PromptResolver`` turns it into the version the registry holds
(hash-checked as above) and checks that the prompt served is that template rendered (its literal
text in order around the variables); an unknown name, version or alias, or another text, is
refused, so a trace never names a version that was not there or not used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import threading
import time

from tpulab.errors import TpulabError
from tpulab.model.sampling import MAX_PROMPT_CHARS
from tpulab.ops import registry_store as R
from tpulab.ops import tags as T
from tpulab.tracking.store import cause

_VAR = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def prompt_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def check_template(template) -> str:
    if not isinstance(template, str) or not template:
        raise TpulabError("a prompt template must be non-empty text")
    if len(template) > MAX_PROMPT_CHARS:
        raise TpulabError(
            f"prompt template has {len(template)} characters, at most {MAX_PROMPT_CHARS}"
        )
    try:
        template.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TpulabError(f"prompt template is not valid UTF-8 (offset {e.start})") from None
    return template


@dataclasses.dataclass(frozen=True)
class Prompt:
    name: str
    version: int
    template: str
    sha256: str

    @property
    def uri(self) -> str:
        return f"prompts:/{self.name}/{self.version}"

    @property
    def variables(self) -> list[str]:
        return sorted(set(_VAR.findall(self.template)))

    def render(self, **values: str) -> str:
        want, got = set(self.variables), set(values)
        if want - got:
            raise TpulabError(f"prompt {self.uri} needs {', '.join(sorted(want - got))}")
        if got - want:
            raise TpulabError(f"prompt {self.uri} has no variable {', '.join(sorted(got - want))}")
        bad = [k for k, v in values.items() if not isinstance(v, str)]
        if bad:
            raise TpulabError(f"prompt {self.uri}: {bad[0]} must be a string")
        return _VAR.sub(lambda m: values[m.group(1)], self.template)


def _of(pv) -> Prompt:
    """A stored version, its hash recomputed: the tag is a claim, the template is what is served."""
    where = f"prompt prompts:/{pv.name}/{pv.version}"
    if not isinstance(pv.template, str):
        raise TpulabError(f"{where} is a chat template; tpulab serves text templates only")
    digest = prompt_sha256(pv.template)
    claim = (pv.tags or {}).get(T.PROMPT_SHA256)
    if claim != digest:
        raise TpulabError(
            f"{where}: tag {T.PROMPT_SHA256} says {(claim or 'nothing')[:12]}, the template "
            f"hashes to {digest[:12]} (edited in the store, or not registered by tpulab)"
        )
    return Prompt(pv.name, int(pv.version), pv.template, digest)


def _versions(reg: R.Registry, name: str) -> list:
    from mlflow.exceptions import MlflowException

    out, token = [], None
    with R.store_call(reg, f"listing prompt {name}"):
        while True:
            try:
                page = reg.client.search_prompt_versions(name, max_results=100, page_token=token)
            except MlflowException as e:
                if R.not_found(e):
                    return []
                raise
            out.extend(page)
            token = page.token
            if not token:
                return sorted(out, key=lambda pv: int(pv.version))


def list_prompts(reg: R.Registry, name: str) -> list[Prompt]:
    """Every version of ``name``, oldest first, each hash-checked."""
    R.check_name(name, "prompt name")
    return [_of(pv) for pv in _versions(reg, name)]


def register_prompt(
    reg: R.Registry, name: str, template: str, *, message: str | None = None
) -> tuple[Prompt, bool]:
    """(the version holding exactly ``template``, whether it was created now)."""
    R.check_name(name, "prompt name")
    digest = prompt_sha256(check_template(template))
    with R.locked(reg):
        for p in list_prompts(reg, name):
            if p.sha256 == digest:
                return p, False
        with R.store_call(reg, f"registering prompt {name}"):
            pv = reg.client.register_prompt(
                name, template, commit_message=message, tags={T.PROMPT_SHA256: digest}
            )
    return _of(pv), True


def load_prompt(reg: R.Registry, name: str, version: int | str) -> Prompt:
    """Version ``version`` of ``name``, its template's hash checked against its tag."""
    from mlflow.exceptions import MlflowException

    R.check_name(name, "prompt name")
    with R.store_call(reg, f"reading prompt {name} v{version}"):
        try:
            pv = reg.client.get_prompt_version(name, str(version))
        except MlflowException as e:
            if not R.not_found(e):
                raise
            pv = None
    if pv is None:
        raise TpulabError(f"no prompt {name} version {version} in {reg.db}")
    return _of(pv)


_REF = re.compile(
    r"(?:prompts:/)?(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,127})"
    r"(?:/(?P<version>[1-9][0-9]{0,9})|@(?P<alias>[A-Za-z][A-Za-z0-9_-]{0,127}))"
)
# What MLflow answers for a prompt, version or alias that is not there (mlflow-skinny 3.17.2):
# RESOURCE_DOES_NOT_EXIST for a name or version, INVALID_PARAMETER_VALUE for an alias or a name
# registered as a model. Any other error is the store failing, not the client asking wrongly.
_ABSENT = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


class PromptStoreError(Exception):
    """The prompt registry could not be read (the service answers 503, not 422)."""


def resolve_prompt(reg: R.Registry, ref: str) -> Prompt:
    """The version ``ref`` names in the registry now, hash-checked; TpulabError if there is none.
    A store that cannot be read raises ``PromptStoreError``."""
    from mlflow.exceptions import MlflowException

    m = _REF.fullmatch(ref) if isinstance(ref, str) else None
    if m is None:
        raise TpulabError(
            f"prompt_version {str(ref)[:80]!r} is not prompts:/NAME/VERSION or prompts:/NAME@ALIAS"
        )
    name, version, alias = m["name"], m["version"], m["alias"]
    try:
        if alias is None:
            pv = reg.client.get_prompt_version(name, version)
        else:
            pv = reg.client.get_prompt_version_by_alias(name, alias)
    except MlflowException as e:
        if getattr(e, "error_code", None) not in _ABSENT:
            raise PromptStoreError(f"prompt registry {reg.db}: {cause(e)}") from None
        pv = None
    except R.store_errors() as e:
        raise PromptStoreError(f"prompt registry {reg.db}: {cause(e)}") from None
    if pv is None:
        which = f"version {version}" if alias is None else f"alias {alias}"
        raise TpulabError(f"no prompt {name} {which} in the registry {reg.db}")
    return _of(pv)


def rendered_from(template: str, text: str) -> bool:
    """Whether ``text`` is ``template`` with something in place of each variable: its literal
    pieces, in order, first at the start and last at the end. Linear in the text (a regex with one
    lazy group per variable backtracks polynomially on a 4096-character prompt)."""
    pieces = _VAR.split(template)[::2]  # the split keeps each variable's name at the odd places
    if len(pieces) == 1:
        return text == template
    first, *middle, last = pieces
    end = len(text) - len(last)
    if end < len(first) or not text.startswith(first) or not text.endswith(last):
        return False
    pos = len(first)
    for piece in middle:
        pos = text.find(piece, pos, end)
        if pos < 0:
            return False
        pos += len(piece)
    return True


class PromptResolver:
    """A service's ``prompt_version`` check: (label, prompt) -> the trace fields naming the
    version the registry holds, or TpulabError (the client's mistake: 422). Every resolution is
    read again after ``ttl_s`` (the service's alias poll interval, as for the model alias): an
    alias may move, and a version, immutable in MLflow, may still be deleted or its template edited
    in the store; either is refused within one TTL. A store that cannot be read on a re-read keeps
    a version's last good answer (nothing can have changed it unseen but a deletion) and fails an
    alias's (``PromptStoreError``: it may have moved)."""

    MAX_CACHED = 1024

    def __init__(self, reg: R.Registry, ttl_s: float, *, clock=time.monotonic):
        self.reg, self.ttl_s, self.clock = reg, ttl_s, clock
        self._cache: dict[str, tuple[Prompt, float]] = {}
        self._lock = threading.Lock()

    def prompt(self, label: str) -> Prompt:
        now = self.clock()
        with self._lock:
            hit = self._cache.get(label)
        if hit is not None and now < hit[1]:
            return hit[0]
        try:
            p = resolve_prompt(self.reg, label)
        except PromptStoreError:
            if hit is None or "@" in label:
                raise
            return hit[0]
        except TpulabError:
            with self._lock:
                self._cache.pop(label, None)
            raise
        with self._lock:
            if len(self._cache) >= self.MAX_CACHED:
                self._cache.clear()
            self._cache[label] = (p, now + self.ttl_s)
        return p

    def __call__(self, label: str, text: str) -> dict:
        p = self.prompt(label)
        if not rendered_from(p.template, text):
            raise TpulabError(
                f"prompt_version {label!r}: the prompt is not {p.uri} rendered (its text outside "
                f"the variables {', '.join(p.variables) or '(none)'} differs)"
            )
        return {
            "prompt_version": p.uri,
            "prompt_label": label,
            "prompt_template_sha256": p.sha256,
            "prompt_resolved": True,
        }
