"""zoff: train PyTorch models too large for one device (and, with a disk, for the host) with ZeRO partitioning
and CPU or NVMe offload."""

__version__ = "0.1.0"
