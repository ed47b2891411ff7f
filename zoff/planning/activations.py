"""Activation bytes per micro-batch: a closed form for the builtin GPT, a meta-device probe for other models.

Part of the memory arithmetic (zoff.planning.memory re-exports it); no process group, no real memory.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn

from zoff.config import DataConfig, ModelConfig
from zoff.engine.precision import DTYPES
from zoff.models import has_analytic_activations, lm_loss, meta_model


@dataclass(frozen=True)
class Activations:
    saved: int  # bytes saved for backward after the forward of one micro-batch (loss included)
    peak: int  # saved, plus with checkpointing one block's recomputed activations
    method: str
    host: int = 0  # train.activation_offload: the checkpointed blocks' inputs, in host memory
    # train.sequence_parallel: the all-to-alls' buffers at their largest, and `peak` were their moment the largest
    exchange: int = 0
    exchange_peak: int = 0


def gpt_activations(
    m: ModelConfig, batch: int, seq: int, precision: str, checkpointing: bool, device_type: str = "cuda",
    loss_tile: int = 0, offload: bool = False, mlp_tile: int = 0, upcast: bool = False,
    sequence_parallel: int = 1,
) -> Activations:  # fmt: skip
    """Bytes the builtin GPT saves for backward, op by op (per token, d = d_model, e = compute bytes):

    block: ln1 input d, ln1 output d, qkv output 3d (SDPA saves q, k, v as views of it), attention output d
    (laid out so the proj input is a view of it), residual d, ln2 output d, fc output 4d, GELU output 4d:
    16d elements; plus LayerNorm mean/rstd (4 values; fp32 on CUDA, the input dtype on CPU), the attention
    logsumexp (fp32 per head) and dropout masks when dropout > 0 (flash attention keeps no seq^2 terms; CPU
    attention with dropout does).
    tail: ln_f input and output 2d, log-softmax of the logits in fp32 (vocab x 4 B), target ids (8 B).
    With checkpointing a block keeps only its input (d) and its other 15d are recomputed one block at a time.
    With loss_tile the tail keeps no logits: backward recomputes one tile's at a time.

    The peak adds what lives only for a moment on top of everything saved (measured with the CUDA allocator
    on an H200, docs/results/gpu_activation_check.json, scripts/gpu_activation_check.py; held by
    tests/integration/test_estimate.py), the largest of:
    - the untiled loss's backward: the fp32 gradients of the log-softmax's output and input, 8 B x vocab per
      token (the forward's own moment, logits in the compute dtype and their fp32 copy, is e + 4 <= 8);
    - a tiled loss's backward: per position of one tile, the recomputed logits, their log-softmax and both
      fp32 gradients (12 B x vocab), plus the head weight's gradient before it is accumulated (vocab x d) and
      the hidden states' gradient (d per token);
    - a block's backward (6d per token: the MLP's 4d gradients and the block's input gradient, and the
      weight gradient of the 4d x d linears), after its recompute (15d) with checkpointing.

    With `offload` (train.activation_offload, with checkpointing) the blocks' inputs (d per token each) are
    in host memory (`host`) and none stays on the device after the forward; backward holds two at a time there
    (the block recomputing and the one fetched ahead of it).

    With `mlp_tile` (train.mlp_tile) the MLP keeps nothing of its own (its fc output and GELU output, 8d, go),
    and backward recomputes one tile at a time: that tile's 8d and their gradients (16d per token of the
    tile) instead of the whole MLP's gradients. (This moment is read from the code, not yet measured on a
    GPU as the others were.)

    With `upcast` (train.cpu_precision=upcast: `precision` is then fp32, the activations', over 16-bit
    weights) the moments add the weights' fp32 copies (zoff/models/upcast.py), read from the code: a block's
    backward holds a 4d x d linear's fp32 copy and its gradient rounded to 16 bits (6 B x 4d^2); a tiled loss
    holds one fp32 copy of the head for all its tiles, that copy's fp32 gradient summing over them, and the
    rounded gradient (10 B x vocab x d); the untiled head's backward its copy and the rounded gradient
    (6 B x vocab x d) beside the logits' fp32 gradient.

    With `sequence_parallel` N the bytes are one rank's: seq / N tokens of each sequence, attention's per-score
    terms the whole sequence's (n_head / N heads attend over all of it), plus ulysses_terms.
    """
    e = DTYPES[precision].itemsize
    stat = 4 if device_type == "cuda" else e
    mask = (1 if device_type == "cuda" else e) if m.dropout > 0 else 0
    d, tokens, n = m.d_model, batch * seq // sequence_parallel, sequence_parallel
    # CPU attention with dropout runs the math kernel in fp32: probabilities, dropout noise and output per
    # score, and fp32 copies of q, k, v in place of the 16-bit qkv output.
    math_attn = device_type == "cpu" and m.dropout > 0
    attn = 12 * m.n_head * seq + 3 * d * (4 - e) if math_attn else 4 * m.n_head
    block = (8 if mlp_tile else 16) * d * e + 4 * stat + attn + 2 * d * mask
    logits = 0 if loss_tile else 4 * m.vocab_size
    tail = 2 * d * e + 2 * stat + logits + 8 + 8 + d * mask  # + the input ids
    fixed = 8 * seq + (0 if loss_tile else 4)  # position ids and the scalar loss (a tiled one saves none)
    offload = offload and checkpointing
    extra, fixed, moment, a2a = ulysses_terms(d, e, batch, seq, n, loss_tile, checkpointing, offload, fixed)
    block += 0 if math_attn else extra
    kept = (0 if offload else d * e) if checkpointing else block
    saved = tokens * (m.n_layer * kept + tail) + fixed
    loss_moment = _loss_moment(m.vocab_size, d, e, tokens, loss_tile, upcast)
    if mlp_tile:  # the block's input gradients, one MLP tile's recompute and gradients
        grads = tokens * 2 * d * e + min(mlp_tile, tokens) * 16 * d * e
    else:
        grads = tokens * 6 * d * e
    block_moment = grads + 4 * d * d * (e + (6 if upcast else 0))
    block_moment += tokens * (block - d * e) if checkpointing else 0
    if offload:
        block_moment += 2 * tokens * d * e
    # (the exchange comes before the loss's forward or after its backward: the tail's bytes are not held then)
    moment = max(0, moment - tokens * tail)
    # (+ the whole sequence's positions, gathered at the first layer and held through the step under N)
    peak = saved + max(loss_moment, block_moment, moment) + (8 * batch * seq if n > 1 else 0)
    how = f"builtin GPT closed form ({'flash-attention' if device_type == 'cuda' else 'CPU'} kernels)"
    host = m.n_layer * tokens * d * e if offload else 0
    return Activations(saved, peak, how, host, a2a, saved + moment + 8 * batch * seq if n > 1 else 0)


def _loss_moment(vocab: int, d: int, e: int, tokens: int, loss_tile: int, upcast: bool) -> int:
    """The loss's backward moment (gpt_activations' docstring says what it holds)."""
    if loss_tile:
        moment = min(loss_tile, tokens) * vocab * 12 + vocab * d * e + tokens * d * e
        return moment + (vocab * d * 10 if upcast else 0)
    moment = tokens * vocab * 8
    if upcast:  # the head's backward: the logits' fp32 gradient, the head's fp32 copy and rounded grad
        moment = max(moment, tokens * vocab * 4 + vocab * d * 6)
    return moment


def ulysses_terms(
    d: int,
    e: int,
    batch: int,
    seq: int,
    n: int,
    loss_tile: int,
    checkpointing: bool,
    offload: bool,
    fixed: int,
) -> tuple[int, int, int, int]:
    """What train.sequence_parallel N adds to the builtin GPT's bytes on a rank (zoff/models/ulysses.py), as
    (bytes a block saves per token beyond gpt_activations' 16d, the fixed bytes in place of `fixed`, the
    exchange's moment, the exchange's buffers at their largest); at N = 1 nothing: (0, fixed, 0, 0).

    Saved: attention's output arrives from the second all-to-all as a tensor of its own, which the projection
    saves in token order beside the (b, n_head / N, seq, head_dim) output the attention kernel saved: d more
    per token (not with CPU attention's math kernel, which saves no output of its own).
    The shard's position ids are per row (batch x seq / N int64, as copied to the device; a rank of a CPU-only
    host keeps views of the whole sequence's ids and positions instead, at most 24 B a token of it more).

    The moment, per token of the rank (d x e each): at the first all-to-all the qkv output (3) lives beside the
    exchange's buffers: its heads concatenated into the send buffer (3), that buffer's permuted copy (3; with
    one sequence per micro-batch the concatenation is already in order and no copy is made), the received
    buffer (3) and its permuted copy (3), which attention keeps (saved, without checkpointing). With
    checkpointing all of it is the recompute's in backward, beside the block's output gradient (1) and its
    first norm's output (1), and with `offload` the two block inputs on the device (2). The output's exchange
    moves a third as much. The first layer of a forward gathers the seq int64 positions of every row (held
    through the step: gpt_activations adds them to the peak), from one part per rank, and compares them to
    0..seq-1."""
    if n == 1:
        return 0, fixed, 0, 0
    fixed = 8 * batch * seq // n + (0 if loss_tile else 4)
    tokens, buffers = batch * seq // n, 3 * (4 if batch > 1 else 3)
    held = buffers + (5 + (2 if offload else 0) if checkpointing else 0)
    moment = tokens * held * d * e + 8 * seq * (batch + 1)
    return d * e, fixed, moment, tokens * buffers * d * e


def saved_bytes(model: nn.Module, fn) -> int:
    """Bytes of the distinct storages autograd saves while `fn()` runs; parameters and buffers are model state."""
    state = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in state:
            seen[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def probe_activations(
    m: ModelConfig, batch: int, seq: int, precision: str, checkpointing: bool, mlp_tile: int = 0
) -> Activations:
    """Any model: forward + loss on the meta device at batch 1 and 2 and the real sequence length.

    Two batch sizes separate what grows with the batch from what does not (the scalar loss); probing at the
    real length keeps whatever grows faster than linearly in seq (the meta device runs the math attention
    kernel, so this over-estimates models that use flash attention on GPUs).
    """

    model = meta_model(m).to(DTYPES[precision]).train()
    if mlp_tile:  # as the run tiles them (models/tiling.py): the tiles' checkpoints keep nothing
        from zoff.models.tiling import tile_mlps

        tile_mlps(model, mlp_tile)
    switch = hasattr(model, "activation_checkpointing")
    if switch:
        model.activation_checkpointing = checkpointing

    vocab = 0

    def probe(b: int) -> int:
        idx = torch.zeros(b, seq, dtype=torch.long, device="meta")

        def forward() -> None:
            nonlocal vocab
            out = model(idx)
            vocab = getattr(out, "logits", out).shape[-1]
            lm_loss(out, torch.zeros_like(idx))

        return saved_bytes(model, forward)

    try:
        with _mask_checks_skipped():
            one, two = probe(1), probe(2)
    except Exception as e:  # data-dependent ops cannot run on meta: say so instead of guessing
        return Activations(0, 0, f"not available: the meta-device probe failed ({type(e).__name__}: {e})")
    how = f"measured: meta-device forward at batch 1 and 2 x seq {seq}, scaled to batch {batch}"
    if checkpointing and not switch:
        how += " (the model has no activation_checkpointing switch)"
    total = (2 * one - two) + batch * (two - one)
    # The loss's backward moment, as gpt_activations has it: fp32 gradients of the log-softmax, 8 B x vocab.
    return Activations(total, total + batch * seq * vocab * 8, how)


@contextlib.contextmanager
def _mask_checks_skipped() -> Iterator[None]:
    """transformers (5.x) builds its attention masks with data-dependent shortcuts (`.all()` of a mask, read
    on the host), which a meta tensor cannot answer; it skips them while tracing, so the probe says it is
    tracing. The mask is then built in full, as a traced model's is: the probe counts it (an over-estimate,
    the safe side). Without this every transformers model's probe failed and its activations counted 0."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "is_tracing"):
        yield
        return
    with mock.patch.object(masking, "is_tracing", lambda *args, **kwargs: True):
        yield


def activations(
    m: ModelConfig, d: DataConfig, precision: str, checkpointing: bool, device_type: str = "cuda",
    loss_tile: int = 0, offload: bool = False, mlp_tile: int = 0, upcast: bool = False,
    sequence_parallel: int = 1,
) -> Activations:  # fmt: skip
    """The builtin GPT's closed form; other models' meta-device probe (which does not model `offload`, nor
    `upcast`'s weight copies: it runs in `precision`, the activations'), at a rank's seq / N tokens under
    train.sequence_parallel N with the all-to-all's moment from the model's heads (probe_exchange)."""
    if has_analytic_activations(m):
        return gpt_activations(
            m, d.batch_size, d.seq_len, precision, checkpointing, device_type, loss_tile, offload, mlp_tile,
            upcast, sequence_parallel,
        )  # fmt: skip
    n = sequence_parallel
    act = probe_activations(m, d.batch_size, d.seq_len // n, precision, checkpointing, mlp_tile)
    if n == 1 or act.method.startswith("not available"):
        return act
    moment, buffers = probe_exchange(
        m, d.batch_size * d.seq_len // n, n, DTYPES[precision].itemsize, checkpointing
    )
    how = f"{act.method}: a rank's tokens under train.sequence_parallel {n}, attending over them alone (the run's "
    how += "attention spans the whole sequence for 1/N of the heads), plus the all-to-all's buffers"
    peak = act.saved + moment
    return Activations(act.saved, max(act.peak, peak), how, exchange=buffers, exchange_peak=peak)


def probe_exchange(m: ModelConfig, tokens: int, n: int, e: int, checkpointing: bool) -> tuple[int, int]:
    """The all-to-all's (moment, buffers) for a transformers model (zoff/models/ulysses.py), a rank's `tokens`
    of it, from its config's heads: the projections' q, k, v, key/value heads replicated to N where N does not
    divide them, then the buffers: the joined send buffer, its permuted copy, the received buffer and its
    permuted copy (four of the exchanged width); with checkpointing, as the builtin GPT's, the block's output
    gradient and its norm's output (2 x hidden). (0, 0) for a model without those keys (which cannot be
    split: ulysses refuses it)."""
    config = getattr(meta_model(m), "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return 0, 0
    hidden = config.hidden_size
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or hidden // heads
    sent = kv if kv % n == 0 else n  # (replicated to N: ulysses_attention's repeat_interleave)
    buffers = tokens * e * 4 * (heads + 2 * sent) * hd
    width = (heads + 2 * kv + (2 * sent if sent != kv else 0)) * hd + (2 * hidden if checkpointing else 0)
    return buffers + tokens * e * width, buffers
