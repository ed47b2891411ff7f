"""model.positions: rotary (the builtin GPT): the rotation gives transformers' Llama rotary bits forward and
backward, keeps only the shared tables for backward, and the model has no position table."""

from __future__ import annotations

import pytest
import torch

from zoff.config import ModelConfig
from zoff.models import build_model, gpt
from zoff.models.rotary import rotary_tables, rotate


def test_the_rotation_gives_llamas_bits_forward_and_backward():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=500000.0)
    torch.manual_seed(0)
    q, k = (torch.randn(2, 4, 10, 16, requires_grad=True) for _ in range(2))
    positions = torch.tensor(
        [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    )  # packed; a shard
    cos, sin = llama.LlamaRotaryEmbedding(config)(q, positions)
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    tables = rotary_tables(positions, 16, 500000.0, torch.float32)
    got_q, got_k = rotate(q, tables), rotate(k, tables)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    g = torch.randn_like(got_q)
    assert torch.equal(*(torch.autograd.grad(y, q, g)[0] for y in (got_q, want_q)))


def test_backward_keeps_only_the_tables():
    saved = []
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    tables = rotary_tables(torch.arange(8), 4, 10000.0, torch.float32)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rotate(q, tables)
    assert len(saved) == 2 and all(any(s is t for t in tables) for s in saved)


def test_a_rotary_gpt_has_no_position_table_and_trains(monkeypatch):
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=16, vocab_size=32, seq_len=8, positions="rotary")
    model = build_model(cfg)
    assert model.wpe is None and not any("wpe" in n for n, _ in model.named_parameters())
    x = torch.randint(0, 32, (2, 8))
    loss = model(x).logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():  # sharper attention than at init, so that positions show in the outputs
        for block in model.blocks:
            block.attn.qkv.weight.mul_(30)
    # rotary positions are relative: the same tokens three places later give the same outputs
    shifted = model(x, position_ids=torch.arange(8).expand(2, 8) + 3)
    assert torch.allclose(shifted, model(x), atol=1e-5)
    # and they are applied: without the rotation the outputs differ
    monkeypatch.setattr(gpt, "rotate", lambda q, tables: q)
    assert not torch.allclose(model(x), shifted, atol=1e-3)
