"""Where a model's attention meets train.sequence_parallel: `split_attention` makes the builtin GPT or a
transformers causal LM (ulysses_hf.py) attend through the Ulysses exchange (ulysses.py), refuses any other
model by name, and checks every forward: a layer that attended around the exchange, or a forward without the
shard's positions in the whole sequence, would train on plausible wrong numbers and is an error instead."""

from __future__ import annotations

import functools

from torch import nn

from zoff.models.gpt import GPT, CausalSelfAttention
from zoff.models.twin import base_of
from zoff.models.ulysses import KEY, SequenceGroup, check_heads, eager_attention


def split_attention(model: nn.Module, sg: SequenceGroup) -> None:
    """Make `model`'s attention run over the group's whole sequences (the builtin GPT, or a transformers causal
    LM of ulysses_hf.HF_MODEL_TYPES); any other model is refused by name. Each forward then checks that every
    attention layer went through the exchange."""
    base = base_of(model)
    if isinstance(base, GPT):
        layers = [m for m in base.modules() if isinstance(m, CausalSelfAttention)]
        check_heads(layers[0].n_head, layers[0].n_head, sg.size, "the model")
        for m in layers:
            m.exchange = functools.partial(eager_attention(), sg=sg, layer=id(m))
        base.sequence_parallel = True
    else:
        from zoff.models.ulysses_hf import split_hf  # (transformers models only)

        layers = split_hf(base, sg)
    _check_every_forward(model, sg, {id(m) for m in layers}, type(base).__name__)


def splittable(model: nn.Module, n: int) -> None:
    """The checks split_attention makes, on a model of any device (the CLI's pre-flight, on the meta model)."""
    base = base_of(model)
    if isinstance(base, GPT):
        heads = next(m for m in base.modules() if isinstance(m, CausalSelfAttention)).n_head
        check_heads(heads, heads, n, "the model")
        return
    from zoff.models.ulysses_hf import hf_splittable

    hf_splittable(base, n)


def _check_every_forward(model: nn.Module, sg: SequenceGroup, layers: set[int], name: str) -> None:
    """A layer that attends around the exchange would see only its rank's tokens and train on a plausible wrong
    number, and so would a forward without the tokens' positions in the whole sequence: each forward needs
    position_ids and checks that every attention layer went through the exchange."""

    def pre(_module, args, kwargs):
        if kwargs.get("position_ids") is None:
            raise RuntimeError(
                f"{KEY}: {name} was called without position_ids (the shard's, in the sequence)"
            )
        sg.stats.attended.clear()
        sg.memo.positions = None  # a new forward: its positions and mask are gathered anew

    def post(_module, _args, _out):
        missed = len(layers - sg.stats.attended)
        if missed:
            raise RuntimeError(
                f"{KEY}: {missed} of {name}'s {len(layers)} attention layers did not go through the sequence "
                "exchange"
            )

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post)
