"""Activation bytes per micro-batch: a closed form for the builtin GPT, a meta-device probe for other models.

Part of the memory arithmetic (zoff.planning.memory re-exports it); no process group, no real memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple
from unittest import mock

import torch
from torch import nn

from zoff.config import DataConfig, ModelConfig
from zoff.engine.precision import DTYPES
from zoff.models import has_analytic_activations, lm_loss, meta_model, packed_attention


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
    sequence_parallel: int = 1, packed: bool = False,
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
    Positions (learned or rotary) and a packed micro-batch's masks (`packed`): position_terms.

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
    e, d, n = DTYPES[precision].itemsize, m.d_model, sequence_parallel
    tokens, stat = batch * seq // n, 4 if device_type == "cuda" else e
    drop = (1 if device_type == "cuda" else e) if m.dropout > 0 else 0
    # CPU attention with dropout runs the math kernel in fp32: probabilities, dropout noise and output per
    # score, and fp32 copies of q, k, v in place of the 16-bit qkv output.
    math_attn = device_type == "cpu" and m.dropout > 0
    attn = 12 * m.n_head * seq + 3 * d * (4 - e) if math_attn else 4 * m.n_head
    pos = position_terms(m, e, batch, seq, n, checkpointing, packed, math_attn)
    block = (8 if mlp_tile else 16) * d * e + 4 * stat + attn + 2 * d * drop + pos.block
    # the tail: what the blocks' output and the loss save, and the embedding's input ids and dropout mask
    head = 2 * d * e + 2 * stat + (0 if loss_tile else 4 * m.vocab_size) + 8
    tail = head + 8 + d * drop
    offload = offload and checkpointing
    extra, moment, a2a = ulysses_terms(d, e, batch, seq, n, checkpointing, offload, m.positions == "rotary")
    block += 0 if math_attn else extra
    kept = (0 if offload else d * e) if checkpointing else block
    layers = 0 if checkpointing else m.n_layer * pos.layer  # (with checkpointing: one in the recompute)
    loss = 0 if loss_tile else 4  # the scalar loss (a tiled one saves none)
    saved = tokens * (m.n_layer * kept + tail) + pos.fixed + layers + loss
    loss_moment = _loss_moment(m.vocab_size, d, e, tokens, loss_tile, upcast)
    block_moment = _block_moment(d, e, tokens, mlp_tile, upcast)
    block_moment += tokens * (block - d * e) + pos.layer if checkpointing else 0
    block_moment += 2 * tokens * d * e if offload else 0
    # the last layer's exchanges are the largest: the loss's bytes are not held then, nor what the layer saves
    # after its first norm (not yet, or gone); with checkpointing its first norm's statistics are recomputed
    after = -2 * stat * tokens if checkpointing else tokens * (block - 2 * d * e - 2 * stat) + pos.layer
    moment = moment - tokens * head - after if n > 1 else 0
    peak = saved + max(loss_moment, block_moment, moment) + pos.held
    how = f"builtin GPT closed form ({'flash-attention' if device_type == 'cuda' else 'CPU'} kernels)"
    how += ", packed examples' attention masks counted" if packed else ""
    host = m.n_layer * tokens * d * e if offload else 0
    return Activations(saved, peak, how, host, a2a, saved + moment + pos.held if n > 1 else 0)


def _loss_moment(vocab: int, d: int, e: int, tokens: int, loss_tile: int, upcast: bool) -> int:
    """The loss's backward moment (gpt_activations' docstring says what it holds)."""
    if loss_tile:
        moment = min(loss_tile, tokens) * vocab * 12 + vocab * d * e + tokens * d * e
        return moment + (vocab * d * 10 if upcast else 0)
    moment = tokens * vocab * 8
    if upcast:  # the head's backward: the logits' fp32 gradient, the head's fp32 copy and rounded grad
        moment = max(moment, tokens * vocab * 4 + vocab * d * 6)
    return moment


def _block_moment(d: int, e: int, tokens: int, mlp_tile: int, upcast: bool) -> int:
    """A block's backward moment without its recompute (gpt_activations' docstring says what it holds)."""
    if mlp_tile:  # the block's input gradients, one MLP tile's recompute and gradients
        grads = tokens * 2 * d * e + min(mlp_tile, tokens) * 16 * d * e
    else:
        grads = tokens * 6 * d * e
    return grads + 4 * d * d * (e + (6 if upcast else 0))


class PositionTerms(NamedTuple):
    block: int  # bytes a block saves per token beyond its 16d
    fixed: int  # bytes saved once a micro-batch
    layer: int  # bytes each layer's attention saves once
    held: int  # bytes held through the step that autograd does not save


def position_terms(
    m: ModelConfig, e: int, batch: int, seq: int, n: int, checkpointing: bool, packed: bool, math_attn: bool
) -> PositionTerms:
    """What the builtin GPT's positions (model.positions) and a packed micro-batch's masks add to its bytes at
    train.sequence_parallel `n` (zoff/models/gpt.py, rotary.py, ulysses.py; measured op by op on the CPU
    kernels: tests/integration/test_estimate.py, test_sequence_parallel_estimate.py).

    learned: the position embedding saves its ids: 0..seq-1 (8 B x seq), or per row where position ids are
    given (packed data, and always under N: 8 B a token of the rank).
    rotary: no position table. The (cos, sin) tables, each (rows, 1, seq / N, head_dim) in the compute dtype
    (rows: 1 for a plain forward, the batch where position ids are given), are computed once a forward and kept
    by every layer's rotation (with checkpointing by the checkpoints, whose recompute rotates again; autograd's
    saved tensors do not show them there, but they are held). Without N, attention saves the rotated q and k
    (2d a token) beside v, a view of the qkv output, which stays saved; under N it saves the exchange's outputs
    and the rotated q and k go once exchanged. CPU attention with dropout (the math kernel) saves scaled copies
    of its own either way. Under N the shard's position ids are saved by the checkpoints, or without
    checkpointing held by ulysses' ForwardMemo through the step (`held`).
    packed (data.format chat or instruction, packed: position ids restart at each example): every layer's
    attention saves the (batch, 1, seq, seq) boolean mask converted to the compute dtype, batch x seq^2 x e
    over the whole sequence under N (the math kernel adds it in place and saves none; on CUDA the
    memory-efficient kernel keeps it as its bias: read from the code, not measured on a GPU). The boolean
    mask itself, batch x seq^2 B, is built once a forward: under N by the first layer and held by ForwardMemo
    through the step; without N saved by the checkpoints, or without checkpointing alive through the forward
    only (counted as held: an over-estimate by that much). Under N, where the boolean mask would pass
    packed_attention.MASK_LIMIT, each example attends alone through causal attention instead: no mask at all,
    and what attention saves is the unpacked micro-batch's. Under N the whole sequence's positions
    (8 B x batch x seq), gathered at the first layer, are held through the step."""
    rotary, hd = m.positions == "rotary", m.d_model // m.n_head
    given = packed or n > 1  # position ids per row: a packed micro-batch's, or the shard's
    ids = 8 * (batch * seq // n if given else seq)
    block = 2 * m.d_model * e if rotary and n == 1 and not math_attn else 0
    if rotary:
        tables = 2 * (batch if given else 1) * (seq // n) * hd * e
        fixed = tables + (ids if n > 1 and checkpointing else 0)
        held = ids if n > 1 and not checkpointing else 0
    else:
        fixed, held = ids, 0
    mask = batch * seq * seq if packed else 0
    if n > 1 and mask > packed_attention.MASK_LIMIT:  # (the examples attend one by one, unmasked)
        mask = 0
    if n == 1 and checkpointing:
        fixed += mask
    else:
        held += mask
    held += 8 * batch * seq if n > 1 else 0
    return PositionTerms(block, fixed, mask * e if packed and not math_attn else 0, held)


def ulysses_terms(
    d: int, e: int, batch: int, seq: int, n: int, checkpointing: bool, offload: bool, rotary: bool
) -> tuple[int, int, int]:
    """What train.sequence_parallel N adds to the builtin GPT's bytes on a rank (zoff/models/ulysses.py), as
    (bytes a block saves per token beyond gpt_activations' 16d, the exchanges' moment, the exchange's buffers
    at their largest); at N = 1 nothing.

    Saved: attention's output arrives from the second all-to-all as a tensor of its own, which the projection
    saves in token order beside the (b, n_head / N, seq, head_dim) output the attention kernel saved: d more
    per token (not with CPU attention's math kernel, which saves no output of its own).

    The buffers (_to_heads): q, k and v are copied straight into one send buffer (3d a token of the rank), the
    all-to-all fills a receive buffer of its size, and the send buffer is freed before the received one is
    laid out into q, k and v of the rank's heads over the whole sequence (3d, which attention saves): 6d at
    once. The moment, per token of the rank (d x e each), beyond what the layer has saved by its first norm
    (measured: tests/integration/test_sequence_parallel_estimate.py), the larger of
    - forward: the qkv output (3; v is a view of it), with rotary positions the rotated q and k (2), and the
      buffers (6); in a recompute also the block's output gradient (1);
    - backward, where the same exchange turns the q, k and v gradients back into tokens: those gradients (3,
      copied straight into the send buffer), the buffers (6) and the residual stream's gradient (1): 10;
    with checkpointing plus the recomputed first norm's output (1), and with `offload` the two block inputs on
    the device (2). The output's exchange moves a third as much. The first layer of a forward gathers the seq
    int64 positions of every row from one part per rank and compares them to 0..seq-1 (8 B x seq x
    (batch + 1))."""
    if n == 1:
        return 0, 0, 0
    tokens = batch * seq // n
    forward = 3 + (2 if rotary else 0) + 6 + (1 if checkpointing else 0)
    held = max(forward, 10) + (1 + (2 if offload else 0) if checkpointing else 0)
    return d * e, tokens * held * d * e + 8 * seq * (batch + 1), tokens * 6 * d * e


def saved_bytes(model: nn.Module, fn, also: Callable[[], list[torch.Tensor]] | None = None) -> int:
    """Bytes of the distinct storages autograd saves while `fn()` runs; parameters and buffers are model state.
    `also`: tensors kept for backward outside autograd's saved tensors, asked for after `fn()` (a
    non-reentrant checkpoint holds its arguments nested in a tuple, the rotary tables, in its frame)."""
    state = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in state:
            seen[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    for t in also() if also else []:
        pack(t)
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
            upcast, sequence_parallel, packed(d),
        )  # fmt: skip
    n = sequence_parallel
    act = probe_activations(m, d.batch_size, d.seq_len // n, precision, checkpointing, mlp_tile)
    if packed(d) and not act.method.startswith("not available"):  # (the probe runs one example a row)
        how = "; packed examples' attention masks (up to batch x seq^2 x e a layer) not counted"
        act = dataclasses.replace(act, method=act.method + how)
    if n == 1 or act.method.startswith("not available"):
        return act
    e = DTYPES[precision].itemsize
    moment, buffers = probe_exchange(m, d.batch_size, d.seq_len, n, e, checkpointing)
    how = f"{act.method}: a rank's tokens under train.sequence_parallel {n}, attending over them alone (the run's "
    how += "attention spans the whole sequence for 1/N of the heads), plus the all-to-all's buffers"
    peak = act.saved + moment
    return Activations(act.saved, max(act.peak, peak), how, exchange=buffers, exchange_peak=peak)


def packed(d: DataConfig) -> bool:
    """Whether the builtin GPT trains packed micro-batches: fine-tuning data (data.format chat or instruction)
    unless data.packing is never (the GPT keeps packed examples apart, so auto packs it)."""
    return d.format != "text" and d.packing != "never"


def probe_exchange(
    m: ModelConfig, batch: int, seq: int, n: int, e: int, checkpointing: bool
) -> tuple[int, int]:
    """The exchanges' (moment, buffers) for a transformers model (zoff/models/ulysses.py) on a rank holding
    seq / N tokens of each of `batch` sequences, from its config's H query and K key/value heads, in heads'
    worth a token of the rank, as the builtin GPT's (ulysses_terms). ulysses_attention is handed the rotated q
    and k and v (H + 2K); where N does not divide K it replicates k and v to N heads, which live through the
    exchange, whose send and receive buffers hold H + 2 x (K or N) each; once it returns the rank's key/value
    heads are repeated up to its query heads (GQA) beside what it received; attention's output (H) then goes
    back through the same buffers (2H) beside the q, k and v attention saved (3H). `buffers` is the most of
    those at once (measured: tests/integration/test_sequence_parallel_estimate.py). The moment adds the inputs,
    or in backward: the gradients of q, k and v (3H), summed back to the received key/value heads under GQA,
    their contiguous copies and the buffers (3 x the exchanged width) and the residual stream's gradient
    (hidden); with checkpointing the block's output gradient and its norm's output (2 x hidden); and the
    first layer's gathered positions. (0, 0) for a model without those keys (which cannot be split: ulysses
    refuses it)."""
    config = getattr(meta_model(m), "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return 0, 0
    hidden, tokens = config.hidden_size, batch * seq // n
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or hidden // heads
    sent = kv if kv % n == 0 else n  # (replicated to N: ulysses_attention's repeat_interleave)
    exchanged = heads + 2 * sent
    replicas = 2 * sent if sent != kv else 0
    gqa = 2 * heads if sent != heads else 0  # (repeated up to the query heads)
    inside = max(replicas + 2 * exchanged, exchanged + gqa, 6 * heads)
    backward = (3 * heads + (2 * sent if gqa else 0) + 3 * exchanged) * hd + hidden
    held = max((heads + 2 * kv + inside) * hd, backward) + (2 * hidden if checkpointing else 0)
    return tokens * e * held + 8 * seq * (2 * batch + 1), tokens * e * inside * hd
