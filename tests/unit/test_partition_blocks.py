"""Stage 3's units follow the model's repeated blocks (engine/partition.find_blocks), like FSDP2's."""

from __future__ import annotations

from torch import nn

from zoff.engine.partition import find_blocks, plan_partition


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.experts = nn.ModuleList(Expert() for _ in range(2))  # inside a block: not blocks themselves


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(MoELayer() for _ in range(3))
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))  # mixed classes: not blocks
        self.tower = nn.Sequential(Expert(), Expert())  # a Sequential of one class: blocks
        self.head = nn.Linear(8, 16)


def test_blocks_are_repeated_layers_and_never_nest() -> None:
    assert find_blocks(Model()) == ["layers.0", "layers.1", "layers.2", "tower.0", "tower.1"]


def test_hf_no_split_modules_name_blocks() -> None:
    model = Model()
    model._no_split_modules = ["MoELayer"]
    model.tower = nn.Linear(8, 8)
    assert find_blocks(model) == ["layers.0", "layers.1", "layers.2"]


def test_stage3_units_gather_by_block_and_the_rest_is_the_root() -> None:
    plan = plan_partition(Model(), 2, 10_000, per_block=True, persistence_threshold=0)
    owners = {}
    for u in plan.units:
        for si in u.slots:
            owners[plan.slots[si].names[0]] = u.modules[0]
    assert owners["layers.1.experts.0.fc.weight"] == "layers.1"
    assert owners["tower.0.fc.bias"] == "tower.0"
    assert {owners[n] for n in ("emb.weight", "mlp.0.weight", "head.weight")} == {""}


def test_classes_naming_parts_of_the_layers_pick_parts_inside_the_layers_only() -> None:
    """["Linear"] gathers each linear of the layers part by part; the head and the non-repeated Sequential,
    Linear too, stay in the root (a tiled loss reads the head's weight outside any call of it)."""
    assert find_blocks(Model(), ("Linear",)) == [
        *(f"layers.{i}.{p}" for i in range(3) for p in ("router", "experts.0.fc", "experts.1.fc")),
        "tower.0.fc", "tower.1.fc",
    ]  # fmt: skip


def test_named_parts_go_below_hf_no_split_layers() -> None:
    """transformers' _no_split_modules names the decoder layer; parts named in zero.block_classes still split it."""
    model = Model()
    model._no_split_modules = ["MoELayer"]
    assert find_blocks(model) == ["layers.0", "layers.1", "layers.2", "tower.0", "tower.1"]
    assert find_blocks(model, ("Expert",)) == [
        *(f"layers.{i}.experts.{e}" for i in range(3) for e in range(2)), "tower.0", "tower.1",
    ]  # fmt: skip


def test_a_layer_named_with_its_parts_stays_whole() -> None:
    """The larger unit wins: naming the layer's class too (as the regather restart adds it, after a rank
    skipped a whole layer) gathers that layer whole, parts and all."""
    assert find_blocks(Model(), ("Linear", "MoELayer")) == [
        "layers.0", "layers.1", "layers.2", "tower.0.fc", "tower.1.fc",
    ]  # fmt: skip
