"""train.cpu_precision=upcast (issue 52): a bf16 model computed in fp32 on the CPU over its bf16 storage.

Held three ways: its autograd functions give the bits of plain autograd over upcast weights (without keeping
an fp32 copy of a weight for backward); its forward and backward equal an fp32 model's over the same weights;
and a whole run (stages 1 and 3, memory and disk tiers) equals plain PyTorch's mixed precision written out by
hand (bf16 weights, fp32 compute, gradients rounded to bf16, torch.optim.AdamW over fp32 masters) within
1e-5, its parameters and gradients in bf16 as configured."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import assert_close_losses, assert_close_params, plain_optimizer, run_zoff, spawn
from zoff.config import config_from_dict
from zoff.data import GlobalBatches, load_corpus
from zoff.errors import UserError
from zoff.models import build_model, lm_loss
from zoff.models.upcast import _Embedding32, _Linear32, upcast_compute
from zoff.trainer.schedule import lr_at

BF16 = torch.bfloat16


def _saved_dtypes(fn) -> list[tuple[torch.dtype, tuple]]:
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_the_linear_gives_autograds_bits_and_keeps_the_16_bit_weight():
    torch.manual_seed(0)
    w = torch.randn(24, 16).to(BF16).requires_grad_()
    b = torch.randn(24).to(BF16).requires_grad_()
    x = torch.randn(3, 5, 16, requires_grad=True)
    out = {}
    saved = _saved_dtypes(lambda: out.setdefault("y", _Linear32.apply(x, w, b)))
    y = out["y"]
    g = torch.randn_like(y)
    y.backward(g)
    w2, b2, x2 = (t.detach().clone().requires_grad_() for t in (w, b, x))
    y2 = F.linear(x2, w2.float(), b2.float())  # the plain way: autograd keeps w2's fp32 copy
    y2.backward(g)
    assert y.dtype == torch.float32 and torch.equal(y, y2)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad) and torch.equal(b.grad, b2.grad)
    assert w.grad.dtype == BF16 and b.grad.dtype == BF16
    assert (torch.float32, (24, 16)) not in saved and (BF16, (24, 16)) in saved  # no fp32 copy of the weight


def test_the_embedding_gives_autograds_bits():
    torch.manual_seed(0)
    e = torch.randn(10, 4).to(BF16).requires_grad_()
    idx = torch.tensor([[1, 2, 2, 9], [0, 2, 1, 1]])
    for padding_idx in (None, 2):
        e.grad = None
        z = _Embedding32.apply(idx, e, padding_idx)
        g = torch.randn_like(z)
        z.backward(g)
        e2 = e.detach().clone().requires_grad_()
        z2 = F.embedding(idx, e2.float(), padding_idx)
        z2.backward(g)
        assert z.dtype == torch.float32 and torch.equal(z, z2)
        assert e.grad.dtype == BF16 and torch.equal(e.grad, e2.grad.to(BF16))


class _Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return x @ self.mix


def test_a_module_it_cannot_compute_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LayerNorm(4), _Bilinear()))
    with pytest.raises(UserError, match=r"train.cpu_precision=upcast: 1.1 \(_Bilinear\) holds the 'mix' "):
        upcast_compute(model)
    with pytest.raises(UserError, match=r"0 \(nn.Embedding with max_norm"):
        upcast_compute(nn.Sequential(nn.Embedding(4, 4, max_norm=1.0)))
    # one-dimensional parameters compute by type promotion: an RMSNorm-like scale is accepted
    scale = nn.Module()
    scale.weight = nn.Parameter(torch.ones(4))
    assert upcast_compute(nn.Sequential(nn.Linear(4, 4), scale)) == 1


def _gpt_cfg(**train) -> dict:
    return {
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "tie_embeddings": False},
        "data": {"name": "synthetic", "seq_len": 16, "batch_size": 4, "synthetic_tokens": 8000},
        "optim": {"lr": 3e-3, "weight_decay": 0.1},
        "schedule": {"warmup_steps": 2},
        "train": {"max_steps": 6, "grad_clip": 0.5, "log_every": 1, "eval_batches": 1, "precision": "bf16",
                  "cpu_precision": "upcast", **train},
    }  # fmt: skip


def test_forward_and_backward_are_an_fp32_models_over_the_same_weights():
    """The upcast bf16 GPT against an fp32 GPT holding the same (bf16-representable) weights: the loss within
    1e-5 (it is the same arithmetic), every gradient the fp32 gradient rounded to bf16."""
    cfg = config_from_dict(_gpt_cfg())
    torch.manual_seed(0)
    fp32 = build_model(cfg.model)
    with torch.no_grad():
        for p in fp32.parameters():
            p.copy_(p.to(BF16))
    model = copy.deepcopy(fp32).to(BF16)
    # per block 2 LayerNorms and 4 Linears; then wte, wpe, ln_f and the head
    assert upcast_compute(model) == 2 * (2 + 4) + 4
    x = torch.randint(0, cfg.model.vocab_size, (4, 16))
    y = torch.randint(0, cfg.model.vocab_size, (4, 16))
    got = lm_loss(model(x), y)
    want = lm_loss(fp32(x), y)
    got.backward()
    want.backward()
    assert got.dtype == torch.float32 and abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    for (name, p), q in zip(model.named_parameters(), fp32.parameters()):
        assert p.dtype == BF16 and p.grad.dtype == BF16, name
        assert torch.equal(p.grad, q.grad.to(BF16)), name


def upcast_reference(cfg) -> dict:
    """Plain PyTorch, one process, the whole batch: bf16 weights (the fp32 masters rounded), computed in fp32,
    each gradient rounded to bf16, clip_grad_norm_ and torch.optim.AdamW over the fp32 masters."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)  # fp32: what computes, over the bf16 weights copied in each step
    masters = copy.deepcopy(model)
    with torch.no_grad():
        for p in masters.parameters():
            p.copy_(p.to(BF16))
    opt = plain_optimizer(masters, cfg.optim)
    batches = GlobalBatches(
        load_corpus(cfg.data, cfg.train.seed), cfg.data.seq_len, cfg.data.batch_size, 1, 0, 1, cfg.train.seed
    )
    losses, norms = [], []
    for step in range(cfg.train.max_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.optim.lr, cfg.train.max_steps, cfg.schedule)
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters.parameters()):
                p.copy_(m.to(BF16))
        model.zero_grad()
        x, y = batches.micro_batch_at(step, 0)
        loss = lm_loss(model(x), y)
        loss.backward()
        for p, m in zip(model.parameters(), masters.parameters()):
            m.grad = p.grad.to(BF16).float()
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters.parameters(), cfg.train.grad_clip)))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "params": dict(masters.named_parameters())}


def _kept_rank(rank: int, world: int, cfg_dict: dict) -> dict:
    from zoff.trainer.session import build_session

    s = build_session(config_from_dict(cfg_dict), torch.device("cpu"))
    return {"params": {p.dtype for p in s.engine.model.parameters()}, "engine": s.engine.dtype,
            "precision": s.cfg.train.precision}  # fmt: skip


def _zero(kind: str, swap) -> dict | str:
    if kind == "stage 1":
        return {"stage": 1}
    if kind == "zero3-offload":
        return "zero3-offload"
    io = {"threads": 2, "request_mb": 1}
    return {"stage": 3, "param_persistence_threshold": 64,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "io": io, "host_budget": "min"},
            "offload_param": {"device": "nvme", "nvme_path": str(swap), "io": io}}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["stage 1", "zero3-offload", "zero3-nvme"])
def test_a_run_equals_plain_pytorchs_mixed_precision_with_fp32_compute(zero, tmp_path):
    """The run's losses, gradient norms and fp32 masters against upcast_reference within 1e-5; its
    parameters (and so its gathered blocks, gradients and files) bf16, as configured."""
    # the recomputed blocks and the tiled loss's head take the same fp32 path
    extra = {"zero3-offload": {"loss_tile": 8}, "zero3-nvme": {"activation_checkpointing": True}}
    cfg = {**_gpt_cfg(**extra.get(zero, {})), "zero": _zero(zero, tmp_path)}
    got = run_zoff(cfg, 1)[0]
    want = upcast_reference(config_from_dict(cfg))
    assert_close_losses(got["losses"], want["losses"])
    assert_close_losses(got["grad_norms"], want["grad_norms"])
    assert_close_params(got["params"], want["params"])
    kept = spawn(_kept_rank, 1, cfg)[0]
    assert kept == {"params": {BF16}, "engine": BF16, "precision": "bf16"}


def test_the_estimate_counts_the_weights_fp32_copies():
    """gpt_activations(upcast=True): a tiled loss's moment adds the head's fp32 copy, its fp32 gradient and
    the rounded one (10 B x vocab x d); a block's backward a 4d x d linear's copy and rounded gradient."""
    from zoff.config import ModelConfig
    from zoff.planning.activations import gpt_activations

    wide_vocab = ModelConfig(n_layer=2, n_head=2, d_model=64, vocab_size=50_000, seq_len=16)
    args = (wide_vocab, 2, 16, "fp32", True, "cpu")
    plain = gpt_activations(*args, loss_tile=8)
    upcast = gpt_activations(*args, loss_tile=8, upcast=True)
    assert upcast.saved == plain.saved and upcast.peak - plain.peak == 50_000 * 64 * 10
    wide_model = ModelConfig(n_layer=2, n_head=2, d_model=512, vocab_size=64, seq_len=16)
    args = (wide_model, 1, 16, "fp32", False, "cpu")
    plain, upcast = gpt_activations(*args), gpt_activations(*args, upcast=True)
    assert upcast.peak - plain.peak == 4 * 512 * 512 * 6


def test_the_tiled_loss_computes_an_upcast_head_in_fp32_whatever_it_is_handed():
    """16-bit hidden states into an upcast head (a model that casts back to its weights' dtype): the tiles
    compute in fp32 all the same (a bf16 product would miss the fp32 loss by ~1e-3)."""
    from zoff.trainer.loss import tiled_cross_entropy

    torch.manual_seed(0)
    head = nn.Linear(8, 20, bias=False).to(BF16)
    upcast_compute(nn.Sequential(head))
    hidden = torch.randn(12, 8).to(BF16).requires_grad_()
    targets = torch.randint(0, 20, (12,))
    got = tiled_cross_entropy(hidden, head, targets, 4)
    got.backward()
    w = head.weight.detach().float().requires_grad_()
    want = F.cross_entropy(F.linear(hidden.detach().float(), w), targets, reduction="sum")
    want.backward()
    assert got.dtype == torch.float32 and abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    assert head.weight.grad.dtype == BF16  # (the fp32 gradient, rounded: within bf16's half step)
    torch.testing.assert_close(head.weight.grad.float(), w.grad, rtol=2**-8, atol=1e-6)
