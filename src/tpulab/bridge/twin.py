"""The byte Transformer (``tpulab.model.transformer``) as a ``torch.nn.Module``: its PyTorch twin.

Same parameterisation, module for module and name for name (``embed``, ``blocks.{i}.attn_norm``,
``blocks.{i}.attn.qkv``, ``.attn.out``, ``.mlp_norm``, ``.mlp.up``, ``.mlp.down``, ``final_norm``,
``head`` when untied), so a forward hook on a twin module and one on the tpulab module of the same
name see the same tensor (``bridge.layers``). The math, as tpulab's: pre-norm blocks; RMSNorm with
tpulab's ``NORM_EPS`` (``eps`` overrides it: the converter's negative control); fused QKV laid out
``[3, H, Dh]``; RoPE rotating (first half, second half) channel pairs by tpulab's own fp32 tables;
causal softmax attention scaled by 1/sqrt(Dh); the tanh GELU (``jax.nn.gelu``'s default); tied
embeddings unless the config unties them; no biases. Inference only: no dropout (the throughput
benchmark trains it with dropout 0). The weights come from ``bridge.convert_table``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tpulab.model.config import ModelConfig
from tpulab.model.transformer import NORM_EPS, rope_tables


def rope(x_bhtd: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor) -> torch.Tensor:
    """Rotate (first half, second half) channel pairs, as tpulab's ``apply_rope``."""
    x1, x2 = x_bhtd.chunk(2, dim=-1)
    return torch.cat([x1 * cos_td - x2 * sin_td, x1 * sin_td + x2 * cos_td], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_btd, cos_td, sin_td):
        b, t, d = x_btd.shape
        qkv = self.qkv(x_btd).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q_bhtd, k_bhtd = rope(qkv[0], cos_td, sin_td), rope(qkv[1], cos_td, sin_td)
        a_bhtd = F.scaled_dot_product_attention(q_bhtd, k_bhtd, qkv[2], is_causal=True)
        return self.out(a_bhtd.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_btd):
        return self.down(F.gelu(self.up(x_btd), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=eps)
        self.mlp = MLP(cfg)

    def forward(self, x_btd, cos_td, sin_td):
        x_btd = x_btd + self.attn(self.attn_norm(x_btd), cos_td, sin_td)
        return x_btd + self.mlp(self.mlp_norm(x_btd))


class TorchTransformer(nn.Module):
    """tokens [B, T] int64 -> logits [B, T, V] (float32)."""

    def __init__(self, cfg: ModelConfig, eps: float = NORM_EPS):
        super().__init__()
        self.cfg, self.eps = cfg, eps
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, eps) for _ in range(cfg.n_layers))
        self.final_norm = nn.RMSNorm(cfg.d_model, eps=eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, False)
        n = cfg.max_seq_len
        cos, sin = (np.array(x[0]) for x in rope_tables(None, cfg.head_dim, cfg.rope_base, n, n))
        self.register_buffer("cos_td", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin_td", torch.from_numpy(sin), persistent=False)

    def forward(self, tokens_bt: torch.Tensor) -> torch.Tensor:
        t = tokens_bt.shape[1]
        cos_td, sin_td = self.cos_td[:t], self.sin_td[:t]
        x_btd = self.embed(tokens_bt)
        for block in self.blocks:
            x_btd = block(x_btd, cos_td, sin_td)
        h_btd = self.final_norm(x_btd)
        return h_btd @ self.embed.weight.T if self.head is None else self.head(h_btd)


@torch.inference_mode()
def greedy(model: TorchTransformer, prompts_bp: np.ndarray, max_new: int) -> np.ndarray:
    """Greedy continuation [B, max_new] of equal-length prompts: the whole forward again for each
    new token (no cache; the twin is a checked copy, not a server). The first highest logit wins a
    tie, as ``jnp.argmax`` does."""
    tokens = torch.from_numpy(np.asarray(prompts_bp, np.int64))
    for _ in range(max_new):
        nxt = model(tokens)[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompts_bp.shape[1] :].numpy().astype(np.int32)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` for the block, then put back. Beside JAX in one
    process on a shared host, torch's spinning OpenMP workers are the bottleneck: 32 greedy steps
    of the default twin took 23.5 s on 2 threads and 0.78 s on 1, at load 6.4 on 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
