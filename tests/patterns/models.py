"""One tiny model per pattern that real models use, for the zoo's equivalence grid (tests/patterns/test_zoo.py).

Each factory takes zoff's `ModelConfig` (`vocab_size`, `d_model`, `n_layer`) and is usable as
`model.name: python:tests.patterns.models:<factory>`; `forward(idx)` maps token ids (B, T) to logits
(B, T, vocab_size). Every model keeps three rules, because the reference runs ONE forward over the whole
global batch while zoff splits the same samples into micro-batches over ranks:

- per-sample independence: a sample's output depends on that sample only (LayerNorm, never BatchNorm;
  routing and branching decided per token or per sample), so the per-token mean loss is the same however
  the global batch is split;
- deterministic initialisation from torch's global RNG (the harness seeds it before building), fp32, no
  dropout;
- the shape of a real model: an embedding, `self.blocks` (an `nn.ModuleList` of identical blocks), a final
  norm and a head.

The data-dependent models (`moe`, `branch`, `last_micro_unused`) are tuned against the tests' synthetic data
(tests.harness.tiny_cfg: seed 0, micro-batch 2, seq_len 16) so that every parameter is used somewhere in
every step's global batch: the plain-PyTorch reference leaves a parameter that no sample used with
`grad=None` and AdamW then skips it entirely, while a ZeRO engine steps it with a zero gradient (weight decay
and momentum still move it). That is a different question from the one the zoo asks (a parameter unused on
one rank or in one micro-batch), so the zoo avoids it; `test_zoo.py` checks both properties.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# ---------------------------------------------------------------------------------------- building blocks


class MLP(nn.Module):
    """d -> 2d -> d with GELU; the unit every pattern below is made of."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-norm residual block: x + mlp(ln(x))."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class TinyLM(nn.Module):
    """emb -> blocks -> norm -> head. Each pattern below changes one thing of this plain model.

    Subclasses override `body` (what runs between the embedding and the final norm) and/or the block type.
    """

    def __init__(self, cfg, block: type[nn.Module] = Block, head: bool = True):
        super().__init__()
        vocab, d, n = int(cfg.vocab_size), int(cfg.d_model), int(cfg.n_layer)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False) if head else None

    def body(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.logits(self.norm(self.body(self.emb(idx), idx)))


def _recompute(self: nn.Module) -> bool:
    # Checkpoint only where there is a backward to save memory for: evaluation runs under no_grad.
    return self.training and torch.is_grad_enabled()


# ------------------------------------------------------------------------------ activation checkpointing


class CheckpointedBlocks(TinyLM):
    """Pattern: activation checkpointing around every block (`torch.utils.checkpoint`).

    Why it breaks naive engines: backward re-runs each block's forward, so forward hooks fire a second time
    inside backward (a stage-3 engine must gather the block's parameters again, after having released them,
    and must not take the recomputation for the next step's forward), and gradients arrive in a different
    order than without checkpointing. The reentrant variant is harsher still: the recomputed forward runs
    its own `torch.autograd.backward` inside the outer backward, so every block's gradients are accumulated
    from a nested backward call.
    """

    def __init__(self, cfg, reentrant: bool):
        super().__init__(cfg)
        self.reentrant = reentrant

    def body(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            # Reentrant checkpointing needs an input that requires grad: the embedding's output does.
            h = checkpoint(block, h, use_reentrant=self.reentrant) if _recompute(self) else block(h)
        return h


def ckpt_block(cfg) -> nn.Module:
    return CheckpointedBlocks(cfg, reentrant=False)


def ckpt_block_reentrant(cfg) -> nn.Module:
    return CheckpointedBlocks(cfg, reentrant=True)


class CheckpointedShared(TinyLM):
    """Pattern: one shared module (`self.shared`) called twice per forward, each call checkpointed.

    Why it breaks naive engines: the same parameters take part in two recomputations during backward, so
    their gradient is accumulated twice, from two separate re-forwards; an engine that reduces (or releases)
    a parameter when its first gradient arrives, or that counts one gather per module per step, gets the
    second call wrong. Weight sharing across layers like this is ALBERT's and Universal Transformers'.
    """

    def __init__(self, cfg, reentrant: bool):
        super().__init__(cfg)
        d = int(cfg.d_model)
        self.shared = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.reentrant = reentrant

    def body(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:  # with n_layer 2: block, shared, block, shared
            h = block(h)
            if _recompute(self):
                h = h + checkpoint(self.shared, h, use_reentrant=self.reentrant)
            else:
                h = h + self.shared(h)
        return h


def ckpt_shared(cfg) -> nn.Module:
    return CheckpointedShared(cfg, reentrant=False)


def ckpt_shared_reentrant(cfg) -> nn.Module:
    return CheckpointedShared(cfg, reentrant=True)


# --------------------------------------------------------------------------------------- mixture of experts

N_EXPERTS = 4
TOP_K = 2
# Lowers the last expert's router logit at init so that it wins a top-2 slot for only a few tokens: on the
# tests' data it then gets no token in some micro-batches of rank 0 while rank 1 uses it in the same step,
# yet every step's global batch still routes some token to it (test_zoo.py checks both, over the whole run).
# The window is narrow: 0.8 leaves it used almost everywhere, 1.1 already leaves it unused by whole steps on
# 2 ranks without accumulation (the reference would then skip it; see the module docstring).
RARE_EXPERT_BIAS = 1.0


class MoEBlock(nn.Module):
    """A top-2 mixture-of-experts MLP block (Switch/Mixtral style): a router picks 2 of 4 experts per token."""

    def __init__(self, d: int, rare_bias: float = RARE_EXPERT_BIAS):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.router = nn.Linear(d, N_EXPERTS)
        self.experts = nn.ModuleList(MLP(d) for _ in range(N_EXPERTS))
        with torch.no_grad():  # consumes no RNG: the init stays a pure function of the seed
            self.router.bias[-1] -= rare_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.ln(x).reshape(-1, x.shape[-1])  # (tokens, d): routing is per token
        top, chosen = self.router(flat).topk(TOP_K, dim=-1)
        weight = top.softmax(dim=-1)  # softmax over the chosen experts' logits only (Mixtral)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():  # an expert with no token does not run: its parameters get no gradient at all
                out = out.index_add(0, token, expert(flat[token]) * weight[token, slot, None])
        return x + out.view_as(x)


class MoE(TinyLM):
    """Pattern: mixture of experts with top-k routing, each expert run only on the tokens routed to it.

    Why it breaks naive engines: which parameters get a gradient depends on the data, so it differs between
    micro-batches and between ranks. An expert that received no token on one rank must still take part in
    that step's gradient reduction (as zeros) while another rank sends its real gradient; an engine that
    waits for every parameter's gradient hook, or that reduces only the parameters it saw, deadlocks or
    drops gradients. At stage 3 an unused expert's module never runs, so its parameters are never gathered.
    """

    def __init__(self, cfg):
        super().__init__(cfg, block=MoEBlock)


def moe(cfg) -> nn.Module:
    return MoE(cfg)


# Low enough that the last expert gets no token in the whole global batch of some steps, on the tests' data.
IDLE_EXPERT_BIAS = 1.4


class IdleExpertBlock(MoEBlock):
    def __init__(self, d: int):
        super().__init__(d, rare_bias=IDLE_EXPERT_BIAS)


class MoEIdleExpert(TinyLM):
    """Pattern: an expert that no token of a whole step picks, on any rank, in some steps.

    Why it breaks ZeRO engines silently: torch's optimizers skip a parameter whose .grad is None (no weight
    decay, no moment decay, its own step count for the bias correction stays behind), while an engine that
    steps a flat shard updates it with a zero gradient: weight decay and momentum still move it, and its
    bias correction runs ahead.
    """

    def __init__(self, cfg):
        super().__init__(cfg, block=IdleExpertBlock)


def moe_idle_expert(cfg) -> nn.Module:
    return MoEIdleExpert(cfg)


# ------------------------------------------------------------------------------- data-dependent branches


def _branch_rows(sel: torch.Tensor) -> torch.Tensor:
    return sel.nonzero().squeeze(1)


class Branch(TinyLM):
    """Pattern: data-dependent control flow: `self.extra` runs only on the samples whose tokens ask for it.

    Why it breaks naive engines: in a given step one rank may run `extra` and another not, so `extra`'s
    gradient hooks fire on some ranks only; the engine must still reduce its gradient (zeros from the
    ranks that skipped it) and must not wait forever for a hook that never fires. Real models do this with
    modality- or task-specific adapters and with early exits.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.extra = MLP(int(cfg.d_model))

    @staticmethod
    def condition(idx: torch.Tensor) -> torch.Tensor:
        # An odd first token: about half the samples. On the tests' data every step's global batch holds one
        # (so `extra` never goes unused by a whole step) and some micro-batch of rank 0 holds none.
        return idx[:, 0] % 2 == 1

    def body(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](h)
        rows = _branch_rows(self.condition(idx))
        if rows.numel():  # out of place: index_add returns a new tensor, the branch's input stays saved
            h = h.index_add(0, rows, self.extra(h[rows]))
        for block in self.blocks[1:]:
            h = block(h)
        return h


def branch(cfg) -> nn.Module:
    return Branch(cfg)


class LastMicroUnused(TinyLM):
    """Pattern: a parameter used only by rarer samples, so it is used early in an accumulation window but
    not in its last micro-batch.

    `self.domain` (a raw `nn.Parameter`, like a learned domain or task embedding) is added to the hidden
    state of the samples whose first token is 2 mod 3 (about a third of them). With gradient accumulation 3
    on 2 ranks the tests' data has steps (steps 2 and 3 of 12) in which rank 0 uses it in micro-batch 1 or 2
    and not in micro-batch 3 (test_zoo.py checks this).

    Why it breaks naive engines: an engine that reduces a parameter from its gradient hook during the last
    (synchronising) micro-batch never sees a hook for `domain` then, so the gradient it accumulated in the
    earlier micro-batches is never reduced (or is reduced a step late, or as zeros); and at stage 2 the
    gradient accumulated before the last micro-batch must survive until the reduction.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.domain = nn.Parameter(torch.randn(int(cfg.d_model)) * 0.1)

    @staticmethod
    def condition(idx: torch.Tensor) -> torch.Tensor:
        # Tuned on the tests' data: every step's global batch (every world/accumulation of the grid) holds such
        # a sample, so `domain` is never unused by a whole step; rarer conditions (mod 4, 5, 7) are not.
        return idx[:, 0] % 3 == 2

    def body(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        rows = _branch_rows(self.condition(idx))
        if rows.numel():
            h = h.index_add(0, rows, self.domain.expand(rows.numel(), h.shape[1], -1))
        return super().body(h, idx)


def last_micro_unused(cfg) -> nn.Module:
    return LastMicroUnused(cfg)


# ------------------------------------------------------------------- blocks that some ranks skip entirely


class OuterExperts(TinyLM):
    """Pattern: the experts are the model's outermost repeated modules (`self.blocks` is the expert list, as in
    DeepSeek's reference code and older transformers MoE layers), each run only on the tokens routed to it and
    skipped when it gets none. Routing is by token id (Hash Layers, Roller et al. 2021), scaled by a learned
    gate: the last expert takes the rare tokens, so some micro-batches of rank 0 hold none of them.

    Why it breaks ZeRO-3 engines: each expert is a block, gathered around its forward; a rank whose tokens
    skip an expert never gathers it while its peer waits for that rank's shard (a hang in DeepSpeed unless the
    user marks leaf modules, and in FSDP2 unless the whole MoE layer is one unit). zoff names the block and
    the ranks at once; with zero.block_classes naming this model's class (cell_cfg), the whole model is one
    unit every rank gathers.
    """

    def __init__(self, cfg):
        super().__init__(cfg, block=MLP)
        d, n = int(cfg.d_model), int(cfg.n_layer)
        self.ln = nn.LayerNorm(d)
        self.gate = nn.Linear(d, n)

    @staticmethod
    def route(idx: torch.Tensor, n: int) -> torch.Tensor:
        # Tuned on the tests' data (test_zoo.py checks it): token ids that are 3 mod 23 go to the last expert.
        return torch.where(idx % 23 == 3, n - 1, idx % max(1, n - 1))

    def body(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        d, n = h.shape[-1], len(self.blocks)
        flat = self.ln(h).reshape(-1, d)
        gate = torch.sigmoid(self.gate(flat))
        expert_of = self.route(idx.reshape(-1), n)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.blocks):
            token = (expert_of == e).nonzero().squeeze(1)
            if token.numel():  # no token: the expert does not run, on this rank, in this micro-batch
                out = out.index_add(0, token, expert(flat[token]) * gate[token, e, None])
        return h + out.view_as(h)


def outer_experts(cfg) -> nn.Module:
    return OuterExperts(cfg)


class LayerDrop(TinyLM):
    """Pattern: layers chosen by the data (LayerDrop, early exit, mixture-of-depths): block i runs only on the
    samples that select it, and not at all in a micro-batch where none does; each run is checkpointed.

    Why it breaks ZeRO-3 engines: as OuterExperts, a whole block is skipped by some rank's micro-batch while
    another rank runs it. At stage 3 zero.block_classes names this model's class (cell_cfg).
    """

    @staticmethod
    def condition(idx: torch.Tensor, i: int) -> torch.Tensor:
        # Tuned on the tests' data (test_zoo.py checks it): a sample skips block i when its third token is
        # i mod 4: every step's global batch runs every block, and some micro-batch of rank 0 skips one. (The
        # second token instead left a block so rarely run at 3 ranks without accumulation that Adam amplified
        # the reference's own summation order past 1e-5 at every stage, stage 0 included.)
        return idx[:, 2] % 4 != i % 4

    def body(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            rows = _branch_rows(self.condition(idx, i))
            if rows.numel():  # recomputed in backward (activation checkpointing), as large models run
                out = checkpoint(block, h[rows], use_reentrant=False) if _recompute(self) else block(h[rows])
                h = h.index_copy(0, rows, out)
        return h


def layer_drop(cfg) -> nn.Module:
    return LayerDrop(cfg)


# ----------------------------------------------------------------------------------- parameter sharing


class ReuseBlock(nn.Module):
    """fc applied twice, and a raw parameter `mix` used in two expressions (encode with it, decode with its
    transpose, like a tied autoencoder)."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.mix = nn.Parameter(torch.randn(d, d) / math.sqrt(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.ln(x)))
        h = torch.tanh(self.fc(h))  # the same Linear a second time
        code = torch.tanh(h @ self.mix)
        return x + code @ self.mix.t()  # the same raw parameter a second time, transposed


class Reuse(TinyLM):
    """Pattern: one parameter used twice in one forward (a Linear called twice, a raw Parameter in two
    expressions).

    Why it breaks naive engines: autograd accumulates the parameter's gradient from two uses before its
    post-accumulate hook fires once per backward; an engine that reduces on the first gradient, or hooks
    the gradient of each use (`Tensor.register_hook`), reduces half a gradient. At stage 3 a module called
    twice is gathered twice per forward and must not be released while its second call still needs it.
    """

    def __init__(self, cfg):
        super().__init__(cfg, block=ReuseBlock)


def reuse(cfg) -> nn.Module:
    return Reuse(cfg)


class ReadsChildBlock(nn.Module):
    """A block that computes its MLP's first layer itself, from the child's weight: F.linear(x, mlp.fc.weight)."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # mlp.fc's own forward never runs: its parameters are only read by this (parent) module
        a = F.gelu(F.linear(self.ln(x), self.mlp.fc.weight, self.mlp.fc.bias))
        return x + self.mlp.proj(a)


class FunctionalTie(TinyLM):
    """Pattern: parameters read functionally outside their own module's forward.

    The output head is `F.linear(h, self.emb.weight)` computed in the root's forward (weight tying with no
    head module, as many GPT implementations do), and each block calls `F.linear` on its child's
    `mlp.fc.weight` without ever calling `mlp.fc`.

    Why it breaks naive engines: a stage-3 engine that gathers a module's parameters around that module's
    own forward never gathers `mlp.fc` at all, and has released `emb` (its forward ended long ago) by the
    time the root reads `emb.weight` for the head; the embedding's gradient also arrives from two places
    (the lookup and the head), the head's part first.
    """

    def __init__(self, cfg):
        super().__init__(cfg, block=ReadsChildBlock, head=False)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.emb.weight)


def functional_tie(cfg) -> nn.Module:
    return FunctionalTie(cfg)


# ---------------------------------------------------------------------------------- frozen and buffers


class FrozenMiddle(TinyLM):
    """Pattern: a frozen sub-network in the middle (`self.bridge`, a whole block with requires_grad False),
    like a frozen pretrained tower or a frozen adapter host.

    Why it breaks naive engines: the frozen parameters are not in the optimizer and get no gradient, yet
    the gradient must flow *through* them to the trainable blocks before them; an engine that partitions
    or releases them like trainable ones, counts them when waiting for gradients, or casts them and not the
    activations, gets the forward or the backward wrong.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.bridge = Block(int(cfg.d_model))
        self.bridge.requires_grad_(False)

    def body(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        half = max(len(self.blocks) // 2, 1)
        for block in self.blocks[:half]:
            h = block(h)
        h = self.bridge(h)
        for block in self.blocks[half:]:
            h = block(h)
        return h


def frozen(cfg) -> nn.Module:
    return FrozenMiddle(cfg)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position rotation of channel pairs (2i, 2i+1) by position-dependent angles."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class RotaryBlock(nn.Module):
    """x + mlp(rotate(ln(x)) * scale): `scale` is a non-persistent per-channel fp32 buffer."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = MLP(d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = _rotate(self.ln(x), cos, sin) * self.scale.to(x.dtype)
        return x + self.mlp(h)


class Buffers(TinyLM):
    """Pattern: non-persistent fp32 buffers used in forward: a rotary `inv_freq` (root) and a per-channel
    `scale` (each block), as Llama-style models register them (`persistent=False`: not in the state dict).

    Why it breaks naive engines: buffers are not parameters, so they are neither partitioned nor reduced,
    but they must reach the device, and a mixed-precision engine must leave fp32 ones fp32: `inv_freq` cast
    to bf16 gives wrong angles for all but the first positions (rounding of the frequency times the
    position). The forward computes the angles in fp32 and casts cos/sin to the activations' dtype, as
    Hugging Face's rotary embeddings do, so the model runs in any precision.
    """

    def __init__(self, cfg):
        super().__init__(cfg, block=RotaryBlock)
        d = int(cfg.d_model)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def body(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32)
        angle = pos[:, None] * self.inv_freq.float()[None, :]  # (T, d/2), always in fp32
        cos, sin = angle.cos().to(h.dtype), angle.sin().to(h.dtype)
        for block in self.blocks:
            h = block(h, cos, sin)
        return h


def buffers(cfg) -> nn.Module:
    return Buffers(cfg)


# The zoo, in the order the tests list it: pattern name -> factory (the name is the factory's too).
PATTERNS = {
    f.__name__: f
    for f in (
        ckpt_block,
        ckpt_block_reentrant,
        ckpt_shared,
        ckpt_shared_reentrant,
        moe,
        moe_idle_expert,
        branch,
        reuse,
        functional_tie,
        frozen,
        buffers,
        last_micro_unused,
        outer_experts,
        layer_drop,
    )
}
# The patterns whose blocks some rank skips: at stage 3 they gather the whole model as one unit
# (zero.block_classes naming the model's class).
WHOLE_MODEL_UNIT = {"outer_experts": "OuterExperts", "layer_drop": "LayerDrop"}
