"""Memory needs per GPU and per CPU node for every ZeRO policy: pure functions of the config sections.

Used by `zoff estimate`, by `zero: auto` and by the plan `zoff train` prints, so they cannot disagree.

Model states come from the engine's own partition plan, computed on a meta-device model with the arguments
ZeroEngine uses, so padding and stage-3 persistent units match `memory_report()` to the byte. Activations
come from the builtin GPT's shapes (a closed form calibrated with saved-tensor hooks) or, for other models,
from a saved-tensor probe forward on the meta device. No process group, no real memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from zoff.config import Config, DataConfig, ModelConfig, TrainConfig, ZeroConfig
from zoff.engine.disk.budget import host_budget_bytes, mem_total
from zoff.engine.disk.placement import DiskSplit, disk_bytes, grad_disk_bytes, next_params_bytes, subgroup_of
from zoff.engine.disk.traffic import disk_traffic, held_write_back_bytes
from zoff.engine.footprint import frozen_param_bytes, host_staging, model_states, pinned_host_bytes
from zoff.engine.partition import PartitionPlan
from zoff.engine.policy import POLICIES, Policy, engine_plan
from zoff.host.kernels import compute_precision, upcasts
from zoff.models import builds_sharded, has_analytic_activations
from zoff.models import meta_model as meta_model  # (re-exported: tests read it here)
from zoff.planning.activations import Activations, activations
from zoff.planning.buffers import device_buffers
from zoff.planning.buffers import pending_gradients as pending_gradients  # (re-exported: tests read it here)
from zoff.planning.buffers import stage3_working_set as stage3_working_set
from zoff.planning.fits import Budget, Estimate, PolicyEstimate  # (re-exported: callers read them here)
from zoff.planning.gathering import changes_config as changes_config  # (re-exported: callers read them here)
from zoff.planning.gathering import changes_text as changes_text
from zoff.planning.gathering import fit_gathering, shapes
from zoff.planning.gathering import stage3_fallbacks as stage3_fallbacks
from zoff.planning.sequence import check as check_sequence
from zoff.planning.speculation_costs import spending, swap_free_bytes
from zoff.units import human

GPU_KEYS = ("params", "grads", "optimizer_states", "buffers", "activations")
CPU_KEYS = ("params", "grads", "optimizer_states")


# ---------------------------------------------------------------------------------------- model states


def count_params(model: nn.Module) -> tuple[int, int, int]:
    """(distinct params, trainable params, frozen bytes); named_parameters() yields a tied weight once."""
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    return (
        sum(p.numel() for p in params),
        sum(p.numel() for p in params if p.requires_grad),
        sum(p.numel() * p.element_size() for p in frozen),
    )


# --------------------------------------------------------------------------------------------- estimate


def _as_computed(train_cfg: TrainConfig, device_type: str) -> tuple[TrainConfig, str]:
    """(train_cfg in the precision its ranks keep their states in, the precision of their activations), by
    train.cpu_precision on a CPU-only host (the trainer's rule, zoff.host.kernels.compute_precision; upcast
    keeps 16-bit states under fp32 activations), so the estimate counts the bytes the engine allocates."""
    if device_type == "cuda" or train_cfg.cpu_precision == "native":
        return train_cfg, train_cfg.precision  # (native: as configured; no probe)
    precision, _ = compute_precision(train_cfg.precision, train_cfg.cpu_precision, on_cpu=True)
    if upcasts(train_cfg.precision, train_cfg.cpu_precision, on_cpu=True):
        return train_cfg, precision
    return dataclasses.replace(train_cfg, precision=precision), precision


def _activations(
    model_cfg: ModelConfig, data_cfg: DataConfig, train_cfg: TrainConfig, act_precision: str,
    device_type: str, checkpointing: bool,
) -> Activations:  # fmt: skip
    return activations(
        model_cfg, data_cfg, act_precision, checkpointing, device_type, train_cfg.loss_tile,
        train_cfg.activation_offload, train_cfg.mlp_tile,
        act_precision != train_cfg.precision,  # train.cpu_precision=upcast: fp32 activations over 16-bit weights
        train_cfg.sequence_parallel,  # a rank's seq / N tokens and the all-to-all's buffers
    )  # fmt: skip


def activation_offload_budget(cfg: Config, device_type: str) -> int | None:
    """train.activation_offload's host copies per rank, as `zoff estimate` counts them (in CPU/node, and its
    note): the budget of the rank's offload pool. None: a model whose blocks' inputs the plan does not size
    (the meta-device probe does not model the offload)."""
    if not has_analytic_activations(cfg.model):
        return None
    train_cfg, act_precision = _as_computed(cfg.train, device_type)
    return _activations(cfg.model, cfg.data, train_cfg, act_precision, device_type, True).host or None


def estimate(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    train_cfg: TrainConfig,
    zero_cfg: ZeroConfig,
    gpus_per_node: int,
    nodes: int = 1,
    device_type: str = "cuda",
    host_bytes: int | None = None,
    only: Policy | None = None,
    disk_free: int | None = None,
) -> Estimate:
    """Every policy's per-rank device bytes and per-node host bytes for this config on gpus_per_node x nodes
    (`only`: that one policy's, for a run's start-up).

    host_bytes: a node's memory, which zero.offload_optimizer.host_budget auto divides among its ranks for
    the disk tier (default: this host's MemTotal). disk_free: a node's free bytes at nvme_path, shared by its
    ranks, where the disk tier's second slots for speculation fit beside the swap files (None: not limited)."""
    train_cfg, act_precision = _as_computed(train_cfg, device_type)
    world, precision, n = gpus_per_node * nodes, train_cfg.precision, train_cfg.sequence_parallel
    model = shapes(model_cfg)
    check_sequence(model, data_cfg.seq_len, n, gpus_per_node, nodes)  # (one line where N cannot split it)
    gbs = train_cfg.global_batch_size  # (not derive_grad_accum: this world need not divide it)
    # a group of N ranks trains one micro-batch of sequences together: world / N data-parallel ranks
    micro_batches = train_cfg.grad_accum if gbs is None else max(1, gbs // (data_cfg.batch_size * world // n))
    total, trainable, _ = count_params(model)
    plans = {s: engine_plan(model, s, world, zero_cfg) for s in (0, 1, 3)}
    acts = {
        ac: _activations(model_cfg, data_cfg, train_cfg, act_precision, device_type, ac)
        for ac in (False, True)
    }
    host = mem_total() if host_bytes is None else host_bytes
    budget = host_budget_bytes(zero_cfg.offload_optimizer, host, gpus_per_node)
    free = None if disk_free is None else disk_free // gpus_per_node
    rows = _Rows(model, train_cfg, zero_cfg, device_type, gpus_per_node, micro_batches, acts, budget, free)
    policies = (only,) if only is not None else POLICIES
    # stages 1 and 2 share one plan
    out = [rows.row(plans[{2: 1}.get(p.stage, p.stage)], p) for p in policies]
    # The builtin GPT is materialised unit by unit into the engine's buffers (counted above); other models
    # are built whole, in fp32, on every rank before the engine shards them.
    fp32_model = (
        0 if builds_sharded(model_cfg) else sum(p.numel() * p.element_size() for p in model.parameters())
    )
    on_device = fp32_model if device_type == "cuda" else 0  # .to("cpu") of a host model moves nothing
    notes = []
    if acts[True].host and train_cfg.activation_checkpointing:
        notes.append(
            f"train.activation_offload: the blocks' inputs take {human(acts[True].host)} of host memory "
            "per rank (in CPU/node on the rows with act.ckpt on; the run's offload pool keeps to it)"
        )
    if acts[False].method.startswith("not available"):
        notes.append(f"activations {acts[False].method}; counted as 0")
    return Estimate(
        total, trainable, world, gpus_per_node, nodes, precision, acts[False].method, tuple(out),
        {"cpu_bytes_per_node": gpus_per_node * fp32_model, "gpu_bytes": on_device}, tuple(notes), n,
        acts[False].exchange,
    )  # fmt: skip


@dataclass
class _Rows:
    """What every policy's row of one estimate reads (the config's sections, the model's shapes, its
    activations without and with checkpointing, the disk tier's host budget per rank), and the rows."""

    model: nn.Module
    train_cfg: TrainConfig
    zero_cfg: ZeroConfig
    device_type: str
    gpus_per_node: int
    micro_batches: int
    acts: dict[bool, Activations]
    budget: int
    disk_free: int | None  # a rank's share of the free bytes at nvme_path (None: not limited)
    # (plan's stage, params offloaded) -> the frozen weights' bytes: one walk of the model each
    frozen: dict[tuple[int, bool], int] = field(default_factory=dict)

    def frozen_bytes(self, plan: PartitionPlan, pol: Policy) -> int:
        key = (id(plan), pol.offload_param != "none")
        if key not in self.frozen:
            self.frozen[key] = frozen_param_bytes(self.model, plan, self.train_cfg.precision, pol)
        return self.frozen[key]

    def states(
        self, plan: PartitionPlan, pol: Policy, split: DiskSplit
    ) -> tuple[dict[str, int], dict[str, int]]:
        """A rank's device and host bytes by category under `pol`, the disk tier keeping `split` in RAM."""
        zero_cfg, precision, device_type = self.zero_cfg, self.train_cfg.precision, self.device_type
        accumulating = self.micro_batches > 1
        gpu, cpu = model_states(
            plan, pol, precision, frozen_bytes=self.frozen_bytes(plan, pol), device_type=device_type,
            fp32_grad_staging=self.train_cfg.grad_clip > 0 or precision == "fp16",
            delay_update=zero_cfg.offload_optimizer.delay_update, accumulating=accumulating,
            subgroup=subgroup_of(zero_cfg), split=split,
        )  # fmt: skip
        # (the overlapped step's held parameter write-backs are host buffers of the same kind)
        cpu["staging"] = host_staging(pol, zero_cfg, device_type) + held_write_back_bytes(
            plan, pol, zero_cfg, precision, split
        )
        gpu["buffers"] = device_buffers(plan, pol, zero_cfg, precision, device_type, accumulating)
        gpu["activations"] = self.acts[pol.activation_checkpointing].peak
        if self.acts[pol.activation_checkpointing].host:  # train.activation_offload's host copies
            cpu["activations"] = self.acts[pol.activation_checkpointing].host
        return gpu, cpu

    def row(self, plan: PartitionPlan, pol: Policy) -> PolicyEstimate:
        """`pol`'s row: its bytes with the disk tier's split of the host budget, its swap files and traffic,
        and what speculating costs (in RAM, which the budget holds too, and on disk)."""
        zero_cfg, precision, accumulating = self.zero_cfg, self.train_cfg.precision, self.micro_batches > 1
        gpu, cpu = self.states(plan, pol, DiskSplit())
        spec = spending(
            plan, pol, zero_cfg, precision, accumulating, self.budget, host_reserved(gpu, cpu, self.device_type),
            self.train_cfg.grad_clip > 0, self.device_type, self.disk_free, host_used=_host_used(gpu, cpu, self.device_type),
        )  # fmt: skip
        split = spec.split
        if split != DiskSplit():
            gpu, cpu = self.states(plan, pol, split)
        if spec.ram and split.pieces:  # the disk tier's, which its host budget holds (the split's reserved)
            cpu["speculation"] = spec.ram
        # (the host tier's second buffers take only what the host budget leaves: not a need, so not in the
        # CPU column or what must fit; the speculation line and --json say them)
        pinned = pinned_host_bytes(plan, pol, zero_cfg, precision, self.device_type)
        per_node = {k: v * self.gpus_per_node for k, v in cpu.items()}
        delayed = zero_cfg.offload_optimizer.delay_update  # DPU: two gradient files, one used a step
        grad_file = grad_disk_bytes(plan, pol, split, accumulating, precision)
        files = 2 if delayed else 1
        disk = disk_bytes(plan, pol, precision, grad_file * files, delayed) + spec.second.disk_bytes
        traffic = disk_traffic(
            plan, pol, subgroup_of(zero_cfg), precision, self.micro_batches, grad_file, split,
            overlap=zero_cfg.offload_optimizer.overlap_step, delay_update=delayed,
        )  # fmt: skip
        return PolicyEstimate(
            pol, gpu, per_node, self.gpus_per_node, pinned, disk, *traffic, grad_file * files, split,
            grad_files=files, disk_publish=next_params_bytes(plan, pol, precision, delayed), speculation=spec,
        )  # fmt: skip


def mlp_tiles(train_cfg: TrainConfig, data_cfg: DataConfig) -> int:
    """Tiles a micro-batch's MLP runs in on a rank (train.mlp_tile; 1 untiled), of its seq / N tokens."""
    tokens = data_cfg.batch_size * data_cfg.seq_len // train_cfg.sequence_parallel
    return -(-tokens // train_cfg.mlp_tile) if train_cfg.mlp_tile else 1


def estimate_to_fit(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    train_cfg: TrainConfig,
    zero_cfg: ZeroConfig,
    gpus_per_node: int,
    nodes: int,
    device_type: str,
    budget: Budget,
) -> Estimate:
    """estimate() on `budget`'s host memory, finer gathering chosen where whole layers do not fit (fit_gathering)."""

    def at(zero: ZeroConfig) -> Estimate:
        return estimate(
            model_cfg, data_cfg, train_cfg, zero, gpus_per_node, nodes, device_type, budget.cpu,
            disk_free=budget.disk or None,
        )  # fmt: skip

    return fit_gathering(at(zero_cfg), budget, model_cfg, zero_cfg, at, mlp_tiles(train_cfg, data_cfg))


def _host_used(gpu: dict[str, int], cpu: dict[str, int], device_type: str) -> int:
    """Everything a rank holds in host memory (on a CPU-only host its "device" bytes too): what the host tier's
    speculation buffers come after (speculation_costs.spending)."""
    return sum(cpu.values()) + (sum(gpu.values()) if device_type == "cpu" else 0)


def host_reserved(gpu: dict[str, int], cpu: dict[str, int], device_type: str) -> int:
    """A rank's host memory besides the disk tier's, which zero.offload_optimizer.host_budget holds too:
    on a CPU-only host its "device" bytes (parameters, gather buffers, activations: the host is the device),
    and everywhere the parameter shards offloaded to CPU and the pinned staging buffers (per-rank dicts of
    one policy's estimate, before the split). The split holds the disk tier's speculation RAM beside it
    (speculation_costs.spending: the split's `reserved` is both)."""
    device = sum(gpu.values()) if device_type == "cpu" else 0
    return device + cpu.get("params", 0) + cpu.get("staging", 0)


def rank_split(cfg: Config, world: int, local_ranks: int, device_type: str) -> DiskSplit:
    """The split `zoff estimate` prints for cfg's policy at this world: what the engine of a rank of the run
    gets (build_engine's host_reserved is its .reserved), so train and estimate place the same bytes (the
    speculation's RAM counted for the second slots the disk's free room holds now, as the engine fits them)."""
    nodes = max(1, world // max(1, local_ranks))
    policy = Policy.of(cfg.zero, cfg.train.activation_checkpointing)
    est = estimate(
        cfg.model, cfg.data, cfg.train, cfg.zero, max(1, local_ranks), nodes, device_type, only=policy,
        disk_free=swap_free_bytes(cfg.zero) or None,
    )  # fmt: skip
    return est.get(policy).split
