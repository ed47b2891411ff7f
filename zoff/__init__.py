"""zoff: train PyTorch models too large for one device with ZeRO partitioning and CPU offload."""

__version__ = "0.1.0"
