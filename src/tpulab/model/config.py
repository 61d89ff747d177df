"""Model shape and precision policy, and what a model costs in memory (computed from the config
alone).

``param_count`` and ``train_state_bytes`` are the one place for that arithmetic: the host-memory
check before training uses them, and so can any device budget. Upper bounds on the shape fields
are sanity bounds far above anything this project trains; they keep every derived size (elements,
bytes) inside int64 so that an absurd value fails here instead of overflowing inside XLA.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from tpulab.config import check, check_int, field
from tpulab.data.tokenizer import VOCAB_SIZE
from tpulab.model.families import DEFAULT_FAMILY, family, register_family

# Temperatures in (0, MIN_TEMPERATURE) are refused: logits / t overflows float32 to inf (5e-324 is
# 0 in float32), and inf - inf makes the probabilities NaN. 0 means greedy. Here, not in
# model.sampling, so that configs (PPO's among them) validate before jax is imported.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 10.0

DType = Literal["float32", "bfloat16"]
# What each block keeps for the backward pass (``jax.checkpoint`` per block, ``model.transformer``):
# none = every activation; block = only the block's input, the rest recomputed;
# dots_saveable = the matmul outputs, the elementwise ops between them recomputed.
Remat = Literal["none", "block", "dots_saveable"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

# Sanity bounds (see the module docstring): the largest model they allow has < 2**52 parameters, so
# its train-state bytes (x 16 at most) stay far inside int64.
MAX_VOCAB_SIZE = 2**20
MAX_SEQ_LEN = 2**20
MAX_D_MODEL = 2**16
MAX_LAYERS = 2**12
MAX_MLP_RATIO = 64


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Transformer: pre-norm blocks, RoPE, causal attention (or bidirectional), GELU MLP."""

    family: str = field(
        DEFAULT_FAMILY,
        "the model family (tpulab.model.families): transformer, or your own as "
        "package.module:Config (docs/extending.md)",
    )
    vocab_size: int = field(VOCAB_SIZE, "token ids: 256 bytes + BOS + PAD")
    max_seq_len: int = field(128, "longest sequence the model accepts (RoPE table, KV cache)")
    d_model: int = field(128, "residual width")
    n_layers: int = field(4, "Transformer blocks")
    n_heads: int = field(4, "attention heads; must divide d_model")
    mlp_ratio: int = field(4, "MLP hidden width = mlp_ratio * d_model")
    dropout: float = field(0.1, "dropout on attention probabilities and residual branches")
    tie_embeddings: bool = field(True, "share the token embedding with the output head")
    rope_base: float = field(10000.0, "RoPE frequency base")
    remat: Remat = field(
        "none",
        "rematerialization per block: none | block (keep only each block's input, recompute the "
        "rest in the backward pass) | dots_saveable (keep matmul outputs, recompute the rest)",
    )
    causal: bool = field(
        True,
        "causal self-attention (a decoder: position t sees 0..t); false: every position sees "
        "every other (an encoder, for masked-byte training; it cannot generate)",
    )

    def __post_init__(self):
        check(
            self.vocab_size >= VOCAB_SIZE,
            f"model.vocab_size={self.vocab_size} must be >= {VOCAB_SIZE}",
        )
        check(self.max_seq_len > 0, f"model.max_seq_len={self.max_seq_len} must be positive")
        check(self.d_model > 0, f"model.d_model={self.d_model} must be positive")
        check(self.n_layers > 0, f"model.n_layers={self.n_layers} must be positive")
        check_int(self.vocab_size, "model.vocab_size", VOCAB_SIZE, MAX_VOCAB_SIZE)
        check_int(self.max_seq_len, "model.max_seq_len", 1, MAX_SEQ_LEN)
        check_int(self.d_model, "model.d_model", 1, MAX_D_MODEL)
        check_int(self.n_layers, "model.n_layers", 1, MAX_LAYERS)
        check(
            self.n_heads > 0 and self.d_model % self.n_heads == 0,
            f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}",
        )
        check(
            (self.d_model // self.n_heads) % 2 == 0,
            f"model head dim {self.d_model // self.n_heads} must be even for RoPE",
        )
        check(self.mlp_ratio > 0, f"model.mlp_ratio={self.mlp_ratio} must be positive")
        check_int(self.mlp_ratio, "model.mlp_ratio", 1, MAX_MLP_RATIO)
        check(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")
        check(
            self.rope_base > 1,
            f"model.rope_base={self.rope_base} must be > 1 (the RoPE frequencies "
            "base**(-2i/d) must fall with i; a tiny base overflows them to inf)",
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Explicit precision policy: where parameters live, what matmuls run in, what sums run in."""

    param_dtype: DType = field("float32", "dtype parameters and optimizer moments are stored in")
    compute_dtype: DType = field("float32", "dtype of activations and matmul inputs")
    accum_dtype: Literal["float32"] = field(
        "float32",
        "dtype of norms, softmax, logits and the loss (always fp32: reductions in bf16 lose bits)",
    )

    def __post_init__(self):
        check(
            not (self.param_dtype == "bfloat16" and self.compute_dtype == "float32"),
            "precision.compute_dtype=float32 with param_dtype=bfloat16 gains nothing; "
            "use float32 params",
        )


def param_count(cfg: ModelConfig) -> int:  # registered with the family, below
    """Trainable parameters of ``Transformer(cfg)``, from the shapes alone (nothing is built;
    ``transformer.built_param_count`` counts a built module's, LoRA adapters included).

    Embedding ``V*D``; per block two RMSNorm scales ``2D``, fused QKV ``3D*D``, attention output
    ``D*D``, MLP up and down ``2*r*D*D`` (no biases); final norm ``D``; an untied head ``D*V``.
    """
    d, v = cfg.d_model, cfg.vocab_size
    block = 2 * d + 4 * d * d + 2 * cfg.mlp_ratio * d * d
    return v * d + cfg.n_layers * block + d + (0 if cfg.tie_embeddings else d * v)


register_family(DEFAULT_FAMILY, param_count)(ModelConfig)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (2 FLOPs each): the blocks' projections and
    the output head (the embedding table when tied); the embedding lookup and norm scales are not
    matmuls."""
    return (
        cfg.n_layers * (4 * cfg.d_model**2 + 2 * cfg.mlp_ratio * cfg.d_model**2)
        + cfg.d_model * cfg.vocab_size
    )


# Training holds, per parameter: the value, its gradient, and Adam's two moments (in param_dtype).
TRAIN_STATE_COPIES = 4


def train_state_bytes(cfg: Any, precision: PrecisionConfig) -> int:
    """Bytes of parameters + gradients + both Adam moments, stored in ``precision.param_dtype``.

    A lower bound on what training needs: activations, the compiled program and the data pipeline
    come on top.
    """
    return family_param_count(cfg) * TRAIN_STATE_COPIES * DTYPE_BYTES[precision.param_dtype]


def family_param_count(cfg: Any) -> int:
    """Trainable parameters of a model of ``cfg``, by its family's count."""
    return family(cfg.family).param_count(cfg)
