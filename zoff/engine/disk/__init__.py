"""The disk tier (ZeRO-Infinity's NVMe offload): its swap-file I/O, the optimizer states', parameters' and
gradients' swap files, the placement (what stays in RAM, where each piece lies on disk, the walk's order),
the host budget and the bytes a step moves."""
