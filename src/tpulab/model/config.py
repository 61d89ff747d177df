"""Model shape and precision policy."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tpulab.config import check, field
from tpulab.data.tokenizer import VOCAB_SIZE

DType = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only Transformer: pre-norm blocks, RoPE, causal attention, GELU MLP."""

    vocab_size: int = field(VOCAB_SIZE, "token ids: 256 bytes + BOS + PAD")
    max_seq_len: int = field(128, "longest sequence the model accepts (RoPE table, KV cache)")
    d_model: int = field(128, "residual width")
    n_layers: int = field(4, "Transformer blocks")
    n_heads: int = field(4, "attention heads; must divide d_model")
    mlp_ratio: int = field(4, "MLP hidden width = mlp_ratio * d_model")
    dropout: float = field(0.1, "dropout on attention probabilities and residual branches")
    tie_embeddings: bool = field(True, "share the token embedding with the output head")
    rope_base: float = field(10000.0, "RoPE frequency base")

    def __post_init__(self):
        check(self.vocab_size >= VOCAB_SIZE, f"model.vocab_size={self.vocab_size} must be >= {VOCAB_SIZE}")
        check(self.max_seq_len > 0, f"model.max_seq_len={self.max_seq_len} must be positive")
        check(self.d_model > 0, f"model.d_model={self.d_model} must be positive")
        check(self.n_layers > 0, f"model.n_layers={self.n_layers} must be positive")
        check(self.n_heads > 0 and self.d_model % self.n_heads == 0,
              f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        check((self.d_model // self.n_heads) % 2 == 0,
              f"model head dim {self.d_model // self.n_heads} must be even for RoPE")
        check(self.mlp_ratio > 0, f"model.mlp_ratio={self.mlp_ratio} must be positive")
        check(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")
        check(self.rope_base > 0, f"model.rope_base={self.rope_base} must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Explicit precision policy: where parameters live, what matmuls run in, what sums run in."""

    param_dtype: DType = field("float32", "dtype parameters and optimizer moments are stored in")
    compute_dtype: DType = field("float32", "dtype of activations and matmul inputs")
    accum_dtype: Literal["float32"] = field(
        "float32", "dtype of norms, softmax, logits and the loss (always fp32: reductions in bf16 lose bits)")

    def __post_init__(self):
        check(not (self.param_dtype == "bfloat16" and self.compute_dtype == "float32"),
              "precision.compute_dtype=float32 with param_dtype=bfloat16 gains nothing; use float32 params")
