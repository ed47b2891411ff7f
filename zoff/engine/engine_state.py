"""What a ZeroEngine saves and restores: its state_dict (the optimizer's states and step counts, the masters,
the loss scaler, the steps each parameter was skipped), the full fp32 parameters gathered from the masters,
stage 3's frozen shards and a unit's live shard. The checkpoint half of ZeroEngine, a mixin: it reads the
engine's parts, and a load publishes through its Publication.
"""

from __future__ import annotations

import torch


class EngineState:
    def gathered_params(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter at full size in fp32, from the masters (a collective: call on all ranks)."""
        self.stop_speculation()  # (every reader first: the worker owns the disk tier's buffers while it runs)
        self.optimizer.finish()
        out = {}
        for u, unit in enumerate(self.plan.units):
            full = torch.zeros(unit.padded, dtype=torch.float32, device=self.device)
            master = self.optimizer.read(u, "master").to(self.device, torch.float32)
            self.comm.all_gather(master, full) if self.policy.partitioned else full.copy_(master)
            for si in unit.slots:
                s = self.plan.slots[si]
                for name in s.names:
                    out[name] = full[s.offset : s.offset + s.numel].view(s.shape).clone()
        self.comm.stats.reset()
        return out

    def state_dict(self) -> dict:
        self.stop_speculation()
        opt = self.optimizer.state_dict()
        return {
            "optimizer": opt,
            "masters": opt.pop("masters"),
            "scaler": self.scaler.state_dict(),
            "skipped_steps": {s.names[0]: n for s, n in zip(self.plan.slots, self.skipped_steps) if n},
        }

    def load_frozen_shards(self, shards: list[torch.Tensor]) -> None:
        """Stage 3's frozen parameter shards (plan.frozen_units, in order), e.g. from a checkpoint."""
        self.stop_speculation()
        n = len(self.plan.units)
        for u, (dst, src) in enumerate(zip(self.shard_params[n:], shards, strict=True), start=n):
            if self.param_disk is not None and self.param_disk.holds(u):
                self.param_disk.write(u, 0, src)
            else:
                dst.copy_(src)
        if self.param_disk is not None:
            self.param_disk.flush()

    def param_shard(self, u: int) -> torch.Tensor:
        """Unit u's live parameter shard: in memory, or a copy read from the parameter swap file."""
        self.stop_speculation()
        if self.param_disk is not None and self.param_disk.holds(u):
            return self.param_disk.load(u)
        return self.shard_params[u]

    def load_state_dict(self, state: dict) -> None:
        self.stop_speculation()
        skipped = state.get("skipped_steps", {})
        self.skipped_steps = [int(skipped.get(s.names[0], 0)) for s in self.plan.slots]
        self.optimizer.load_state_dict(state["optimizer"])
        for u, src in enumerate(state["masters"] or ()):  # None: already in place (optimizer.load_file)
            self.optimizer.write(u, "master", src)
        self.scaler.load_state_dict(state["scaler"])
        self.publication.publish_all()
