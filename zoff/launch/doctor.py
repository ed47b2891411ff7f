"""`zoff doctor`'s report: this machine as zoff sees it (torch against the checked range, devices, cores, the
CPU Adam path and why, and each dtype's CPU matmul path with its measured time against fp32's)."""

from __future__ import annotations

import torch

from zoff.host.kernels import matmul_path
from zoff.host.versions import checked_range, torch_status
from zoff.launch.rank_server import cores_available
from zoff.optim import backend_info


def machine_report() -> dict:
    """The report as JSON-able values (the command prints it)."""
    return {
        "torch": torch.__version__,
        "torch_checked": checked_range(),
        "torch_status": torch_status(torch.__version__),
        "cuda": torch.cuda.is_available(),
        "gpus": torch.cuda.device_count(),
        "cores": cores_available(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_adam": backend_info(),
        # the CPU's matmul path per dtype: a 16-bit one without a kernel is ~100x fp32 (train.cpu_precision)
        "cpu_matmul": {
            p.dtype: {
                "kernel": p.kernel,
                "x_fp32_time": round(p.factor, 1),
                "slow": p.slow,
                "source": p.source,
            }
            for p in (matmul_path(d) for d in (torch.float32, torch.bfloat16, torch.float16))
        },
    }
