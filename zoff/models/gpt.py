"""A small GPT-style decoder in the spirit of nanoGPT: pre-LayerNorm blocks, causal attention, tied embeddings."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zoff.models.rotary import rotary_tables, rotate


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        # train.sequence_parallel: attention over the group's whole sequence (models/ulysses.py sets it)
        self.exchange: Callable | None = None

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if rope is not None:  # model.positions: rotary
            q, k = rotate(q, rope), rotate(k, rope)
        p = self.dropout if self.training else 0.0
        if self.exchange is not None:  # this rank's tokens, attending over the whole sequence
            y = self.exchange(q, k, v, positions, dropout=p)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:  # packed examples: causal within each example only
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), mask, positions, rope))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Decoder-only transformer; forward(idx) returns logits of shape (batch, seq, vocab)."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        d_model: int,
        vocab_size: int,
        seq_len: int,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        positions: str = "learned",
        rope_theta: float = 10000.0,
    ):
        super().__init__()
        # One draw from the global generator seeds every parameter by name (init_parameter): the weights are
        # the same whether the model is built whole or on the meta device and materialised unit by unit.
        self.init_seed = int(torch.randint(2**62, (), device="cpu"))
        self.n_layer = n_layer
        self.seq_len = seq_len
        # _weight skips nn.Embedding's own normal_ init, which init_parameter overwrites anyway; on the meta
        # device that normal_ alone imports sympy & co. (~75 MB of Python per rank).
        self.wte = nn.Embedding(vocab_size, d_model, _weight=torch.empty(vocab_size, d_model))
        # model.positions: a learned table of seq_len x d_model, or rotary queries and keys (models/rotary.py)
        self.wpe = (
            nn.Embedding(seq_len, d_model, _weight=torch.empty(seq_len, d_model))
            if positions == "learned"
            else None
        )
        self.rope_theta, self.head_dim = rope_theta, d_model // n_head
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.activation_checkpointing = False
        # what runs a checkpointed block: torch's non-reentrant checkpoint, or train.activation_offload's
        # (trainer/activation_offload.py), which keeps the block's input in host memory
        self.checkpoint_fn: Callable | None = None
        # train.sequence_parallel: the input is a shard of each sequence, position_ids its positions in the
        # whole one, and attention builds its mask from the whole sequence's (models/ulysses.py)
        self.sequence_parallel = False
        for name, p in self.named_parameters():
            if not p.is_meta:
                self.init_parameter(name, p.data)

    @torch.no_grad()
    def init_parameter(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` with parameter `name`'s initial value, from its own generator (order-independent)."""
        owner, _, kind = name.rpartition(".")
        module = self.get_submodule(owner)
        if isinstance(module, nn.LayerNorm):
            out.fill_(1.0 if kind == "weight" else 0.0)
        elif kind == "bias":
            out.zero_()
        else:
            # GPT-2's scaled init of residual projections keeps the residual stream's variance flat with depth.
            std = 0.02 / math.sqrt(2 * self.n_layer) if name.endswith("proj.weight") else 0.02
            gen = torch.Generator().manual_seed((self.init_seed + zlib.crc32(name.encode())) % 2**63)
            if out.dtype == torch.float32 and out.device.type == "cpu":
                out.normal_(0.0, std, generator=gen)
            else:  # drawn in fp32 on the host (the generator's device), then rounded and/or moved: the
                # same values as a CPU fp32 model's, whatever the dtype and device
                out.copy_(torch.empty(out.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids`: packed examples, each token's position in its own example; an example starts
        wherever the position does not follow the previous one (transformers' rule), and attends only to
        itself."""
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of length {t} exceeds the model's context of {self.seq_len}")
        pos = torch.arange(t, device=idx.device) if position_ids is None else position_ids
        mask = None if position_ids is None or self.sequence_parallel else example_mask(position_ids)
        positions = pos if self.sequence_parallel else None
        x = self.wte(idx)
        rope = None if self.wpe is not None else rotary_tables(pos, self.head_dim, self.rope_theta, x.dtype)
        x = self.drop(x + self.wpe(pos) if self.wpe is not None else x)
        for block in self.blocks:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Keeps only each block's input; the block's activations are recomputed in backward.
                x = (self.checkpoint_fn or checkpoint)(block, x, mask, positions, rope, use_reentrant=False)
            else:
                x = block(x, mask, positions, rope)
        return self.lm_head(self.ln_f(x))


def example_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean attention mask: causal, and only within each packed example."""
    first = position_ids[:, :1] - 1
    example = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    same = example.unsqueeze(-1) == example.unsqueeze(-2)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)
