"""What exact speculation (zero.offload_optimizer.speculate, engine/step/speculate.py) costs a policy's row of
`zoff estimate`: the disk tier's second slots (disk, fitted into the room its swap files leave) and the RAM it
holds until commit, which the tier's host budget holds too; the host tier's second buffers (RAM). The same
pure functions the engine allocates by (speculation.speculates, second_slots.second_slots and its RAM), so
the estimate, the start-up plan and the engine say the same bytes.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from zoff.config import ZeroConfig
from zoff.engine.disk.placement import DiskSplit, disk_bytes, disk_split, grad_disk_bytes
from zoff.engine.disk.second_slots import (
    SecondSlots,
    host_second_units,
    room_left,
    second_buffer_bytes,
    second_slots,
    speculation_ram_bytes,
)
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import Policy
from zoff.engine.speculation import speculates
from zoff.units import human


def swap_free_bytes(zero_cfg: ZeroConfig) -> int:
    """Free bytes at the disk tier's folder (zero.offload_optimizer.nvme_path); 0 without one. A folder not
    made yet (the engine makes it, swapfile.py) counts the free bytes where it will be made: its nearest
    existing parent's (at 51a0203 such a config's estimate said "no disk tier", while `zoff validate`, and a
    run, took the path)."""
    path = zero_cfg.offload_optimizer.nvme_path
    if not path:
        return 0
    folder = Path(path).expanduser().absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free if folder.is_dir() else 0


def row_speculates(zero: ZeroConfig, policy: Policy, device_type: str) -> bool:
    """Whether an engine of `policy` (its optimizer's tier, whatever the config's device) speculates on this
    device: the engine's own rule."""
    if not policy.offloads_optimizer:
        return False
    oo = dataclasses.replace(zero.offload_optimizer, device=policy.offload_optimizer)
    return speculates(oo, torch.device(device_type), "nvme" if policy.offload_optimizer == "nvme" else "cpu")


@dataclass(frozen=True)
class Spending:
    """A row's disk tier split of its host budget with what speculation costs beside it."""

    split: DiskSplit = DiskSplit()
    second: SecondSlots = SecondSlots()  # the disk tier's speculated units and their second slots
    ram: int = 0  # bytes per rank speculation holds in RAM (speculation_ram_bytes, second_buffer_bytes)
    on: bool = False  # the row speculates (row_speculates)
    units: int = 0  # the host tier: units with second buffers (second_slots.host_second_units)

    def describe(self) -> str:
        """One line for `zoff estimate` (and the start-up plan): what speculating costs this row."""
        if self.split.pieces:  # the disk tier
            ram = f"; {human(self.ram)} of RAM per rank until commit" if self.ram else ""
            return self.second.describe() + ram
        return (
            f"speculation: second buffers (12 B/param/N) for {self.units} units, what the host budget leaves: "
            f"{human(self.ram)} of RAM per rank from the first speculated step"
        )


def spending(
    plan: PartitionPlan, policy: Policy, zero: ZeroConfig, precision: str, accumulating: bool,
    budget: int | None, reserved: int, clipping: bool, device_type: str, free: int | None, host_used: int = 0,
) -> Spending:  # fmt: skip
    """`policy`'s split of the disk tier's host budget (placement.disk_split) and its speculation's costs.
    `free`: bytes at nvme_path for this rank (None: not known, not limited), where the second slots take what
    the swap files leave (speculation.second_slots_of's room).

    The budget holds the speculation's RAM beside `reserved` (the split's `reserved` is both: the trainer hands
    it to the engine). That RAM depends on which units stay streamed, which depends on what is reserved: each
    split reserves what the last one speculates, until one reserves exactly its own speculation's RAM. Where
    the reservations cycle instead (spread_units keeps other units at other rooms), the least one that holds
    its split's speculation is taken: the budget holds, a little of it unused."""
    on = row_speculates(zero, policy, device_type)
    if policy.offload_optimizer != "nvme" or not on:  # (no disk tier: DiskSplit())
        split = disk_split(plan, policy, zero, precision, accumulating, budget, reserved, clipping)
        # the host tier: second buffers for what the host budget leaves beside `host_used`, the rank's host bytes
        units = host_second_units(plan, None if budget is None else budget - host_used) if on else frozenset()
        return Spending(split, ram=second_buffer_bytes(plan, units), on=on, units=len(units))
    counted, tried, holding = 0, set(), None
    while counted not in tried:
        tried.add(counted)
        split = disk_split(plan, policy, zero, precision, accumulating, budget, reserved + counted, clipping)
        grads = grad_disk_bytes(plan, policy, split, accumulating, precision)
        base = disk_bytes(plan, policy, precision, grads)
        second = second_slots(plan, policy, zero, precision, split, room_left(free, base))
        ram = speculation_ram_bytes(plan, policy, precision, second, split.grads_on_disk, accumulating)
        if ram == counted:
            return Spending(split, second, ram, on)
        if ram < counted and (holding is None or counted < holding[0]):
            holding = (counted, Spending(split, second, ram, on))
        counted = ram
    return holding[1]  # (a cycle lowers `counted` somewhere: there is one)


def spending_notes(rows: list[tuple[str, Spending]]) -> list[str]:
    """`zoff estimate`'s lines for the rows (name, costs) that speculate: one per distinct cost, naming its
    rows, as the host budget's split lines are."""
    lines: dict[str, list[str]] = {}
    for name, spec in rows:
        if spec.on:
            lines.setdefault(spec.describe(), []).append(name)
    return [f"{', '.join(names)}: {text}" for text, names in lines.items()]


def spending_json(spec: Spending, local_ranks: int) -> dict | None:
    """A row's speculation costs per node for `zoff estimate --json` (None: the row does not speculate)."""
    if not spec.on:
        return None
    return {"tier": "disk" if spec.split.pieces else "host", "ram_bytes_per_node": spec.ram * local_ranks,
            "units": len(spec.second.units), "candidates": spec.second.candidates,
            "second_slot_bytes_per_node": spec.second.disk_bytes * local_ranks, "room_bytes": spec.second.room}  # fmt: skip
