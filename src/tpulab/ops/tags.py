"""The names of the MLflow Model Registry tags tpulab writes on a model version: one place for them.

A model version's ``source`` is the absolute path of its export artifacts dir. Tags record what the
version claims to be; whoever promotes or serves it re-verifies the artifacts on disk and compares
their digests with these tags (a tag is never trusted alone).
"""

PREFIX = "tpulab."
ARTIFACTS = PREFIX + "artifacts"  # absolute path of the verified export artifacts dir
EXPORT_MANIFEST = PREFIX + "export_manifest_sha256"  # sha256 of the export manifest file
CHECKPOINT = PREFIX + "checkpoint_digest"  # the checkpoint manifest digest the artifacts came from
CORPUS = PREFIX + "corpus_identity"  # corpus / dataset identity of the training run
RUN_ID = PREFIX + "run_id"  # MLflow run id of the training run ("" when none)
RESUME_VERDICT = (
    PREFIX + "resume_verdict"
)  # JSON {"identical": bool, "verdict_sha256": ...} | "absent"
EVAL_PREFIX = PREFIX + "eval."  # + score name: behaviour-evaluation scores, floats as strings
RETIRED = PREFIX + "retired"  # "true" once retired (absent otherwise): never served again
# Added by the registry (opsreg): a registered model's tag, and a prompt version's tag.
LEDGER_HEAD = PREFIX + "ledger_head_sha256"  # sha256 of the model's newest promotion-ledger entry
PROMPT_SHA256 = PREFIX + "prompt_sha256"  # sha256 of a prompt version's template (UTF-8)
