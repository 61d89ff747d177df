"""Generation prompt templates versioned by content hash, kept in MLflow's prompt registry.

Why MLflow's registry: it runs offline on the same sqlite store as the models (mlflow-skinny
3.17.2), numbers immutable versions and names them ``prompts:/NAME/N``, which MLflow tracing can
link to a trace. What it lacks, added here: content identity (registering the same text twice makes
two versions there; here it returns the first) and a check that a stored template is what was
registered: every version carries ``PROMPT_SHA256`` (sha256 of the template's UTF-8 bytes), and
``load_prompt`` recomputes it and refuses a mismatch. Templates use MLflow's ``{{ name }}``
placeholders; ``Prompt.render`` fills them strictly (a missing or unknown variable is an error).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from tpulab.errors import TpulabError
from tpulab.model.sampling import MAX_PROMPT_CHARS
from tpulab.ops import registry as R
from tpulab.ops import tags as T

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
