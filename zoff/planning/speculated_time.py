"""What exact speculation (zero.offload_optimizer.speculate, engine/step/speculate.py) moves in a step for
`zoff estimate --time` (step_time.predict): a step whose clip does not trigger commits every speculated unit,
whose update the worker computed during the last micro-batch's backward, so their bytes and CPU Adam leave
the walk after backward for that backward.

The units and bytes are the row's own (speculation_costs.spending: the same second slots and buffers the
engine makes), not counted again here:
- the disk tier (`second`, second_slots.SecondSlots): each speculated unit's streamed states read from their
  slot and written to the other one (`state_bytes` each way), its gradient read once from the gradient file
  where that is on disk, and with parameters on disk its new shard written to its second region
  (`param_bytes`);
- the host tier: no disk; its second buffers (12 B per element of the units' shards: `ram`) say how many
  parameters the worker's Adam steps.

A step whose clip triggers commits nothing: the walk steps every unit as without speculation (the worker's
work during backward is then lost, which this model leaves out).
"""

from __future__ import annotations

from dataclasses import dataclass

from zoff.planning.memory import PolicyEstimate

STATE_BYTES = 12  # per element: fp32 master, exp_avg and exp_avg_sq (the second slots and buffers hold them)


@dataclass(frozen=True)
class Speculated:
    """What a committed speculation moves from the walk into the last backward, per rank."""

    read: int  # disk bytes the worker reads: the units' states and final gradients
    written: int  # ... and writes: their states' second slots and new parameter shards
    params: int  # elements of the units' shards: the CPU Adam the worker runs


def speculated_work(pe: PolicyEstimate, shard: int) -> Speculated | None:
    """The speculated units' work in `pe`'s step (`shard`: the rank's trainable parameters), or None where the
    row does not speculate (speculation off, delay_update, or no unit has second slots or buffers)."""
    spec = pe.speculation
    if not spec.on:
        return None
    if pe.policy.offload_optimizer != "nvme":  # the host tier: second buffers in RAM, no disk bytes
        params = min(shard, spec.ram // STATE_BYTES) if spec.units else 0
        return Speculated(0, 0, params) if params else None
    second = spec.second
    if not second.units:
        return None
    # (the pieces' states are whole pages: a few KiB over 12 B per element, for each piece)
    params = min(shard, second.state_bytes // STATE_BYTES)
    grads = pe.disk_grads // pe.grad_files if pe.split.grads_on_disk else 0  # (the step's one file)
    grad_read = grads * params // max(1, shard)  # (the file: an aligned region per unit, their share of it)
    return Speculated(second.state_bytes + grad_read, second.state_bytes + second.param_bytes, params)
