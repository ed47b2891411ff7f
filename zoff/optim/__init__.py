"""zoff optimizers: the fused CPU Adam used by ZeRO-Offload (and usable on its own)."""

from zoff.optim.cpu_adam import CPUAdam, backend_info, cpu_adam_step

__all__ = ["CPUAdam", "backend_info", "cpu_adam_step"]
