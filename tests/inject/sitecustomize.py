"""Loaded at start-up by every Python process of a test that puts this folder on PYTHONPATH: pauses a
checkpoint save once every rank has written its files and before they are gathered and renamed, so a test
can kill a rank while the save is half done. The production code carries no hook for it.

ZOFF_TEST_PAUSE_IN_SAVE: seconds to pause; ZOFF_TEST_PAUSE_FLAG: a file written when the pause begins.
"""

import os
import time
from pathlib import Path

if float(os.environ.get("ZOFF_TEST_PAUSE_IN_SAVE", "0") or 0):
    import torch.distributed as dist

    _gather = (
        dist.all_gather_object
    )  # zoff calls it only to gather a save's file list (checkpoint/__init__.py)

    def _paused_gather(*args, **kwargs):
        flag = os.environ.get("ZOFF_TEST_PAUSE_FLAG")
        if flag:
            Path(flag).write_text("paused")
        time.sleep(float(os.environ["ZOFF_TEST_PAUSE_IN_SAVE"]))
        return _gather(*args, **kwargs)

    dist.all_gather_object = _paused_gather
