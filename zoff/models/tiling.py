"""train.mlp_tile: the MLP of each block computed a tile of tokens at a time, each tile recomputed in backward.

An MLP works token by token, and its intermediates are wide: the builtin GPT keeps 8 x d_model per token for
backward (the 4d input and output of its GELU), a Llama MLP 4 x intermediate_size (gate, its activation, up,
their product), more than the rest of the block together. Tiled, each tile of `tile` tokens runs under torch's
non-reentrant checkpoint: its intermediates exist one tile at a time, in forward and again in backward, and
what is kept is the MLP's input (already kept by the block) and nothing more (Arctic Long Sequence Training's
TiledMLP; torchtune and DeepSpeed ship the same idea). Cost: the MLP's forward once more per step (about a
third of a block's work); results equal to the untiled MLP's up to the order of the weight gradient's sums
over tokens (1e-6 relative in fp32).

Which parts: modules named `mlp` whose class name ends in "MLP" (the builtin GPT's, transformers' Llama,
Mistral, Qwen and Gemma families), and any module whose class sets `zoff_sequence_wise = True` (a model's own
mark for a part that treats tokens independently). A mixture of experts is not tiled: its routing statistics
(the load-balancing loss) are taken over all of a batch's tokens at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def sequence_wise_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every part tiling may split (see the module's docstring)."""
    out = []
    for name, module in model.named_modules():
        marked = getattr(type(module), "zoff_sequence_wise", False) is True
        mlp = name.rpartition(".")[2] == "mlp" and type(module).__name__.endswith("MLP")
        if marked or mlp:
            out.append((name, module))
    return out


def tile_mlps(model: nn.Module, tile: int) -> int:
    """Replace each sequence-wise part's forward by its tiled twin; the number of parts tiled."""
    parts = sequence_wise_parts(model)
    for _, module in parts:
        module.forward = _tiled(module.forward, tile)
    return len(parts)


def _tiled(forward: Callable, tile: int) -> Callable:
    def run(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        tokens = x.shape[:-1].numel()
        if tokens <= tile or not torch.is_grad_enabled():
            return forward(x, *args, **kwargs)  # (without grad nothing is kept: one piece is as cheap)
        flat = x.reshape(tokens, x.shape[-1])
        outs = [
            checkpoint(forward, flat[i : i + tile], *args, use_reentrant=False, **kwargs)
            for i in range(0, tokens, tile)
        ]
        out = torch.cat(outs)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    run.__wrapped__ = forward
    return run
