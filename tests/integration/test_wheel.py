"""zoff installed from a wheel, outside the checkout: the shipped configs and recipes come with it.

The wheel is built from this tree and installed without dependencies into a fresh virtual environment whose
only other path is this environment's site-packages (torch and the rest, not zoff: the checkout's
editable install is a .pth hook there, which a path entry does not run). Every command runs in a directory
that is not the checkout.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
        check=True, cwd=tmp,
    )  # fmt: skip
    wheels = list(dist.glob("zoff-*.whl"))
    assert len(wheels) == 1
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(
        subprocess.check_output(
            [venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    deps = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (purelib / "zoff_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(purelib), str(wheels[0])],
        check=True,
    )
    work = tmp / "elsewhere"
    work.mkdir()
    return venv, work


def _zoff(installed: tuple[Path, Path], *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    venv, work = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    code = "import sys; from zoff.cli import main; sys.argv[0] = 'zoff'; main()"
    return subprocess.run(
        [venv / "bin/python", "-c", code, *args],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_the_wheel_ships_configs_and_recipes_and_trains_zero3(installed) -> None:
    venv, work = installed
    where = subprocess.check_output(
        [venv / "bin/python", "-c", "import zoff; print(zoff.__file__)"], cwd=work, text=True
    )
    assert str(venv) in where and str(REPO) not in where  # the wheel's zoff, not the checkout's

    ls = _zoff(installed, "ls")
    assert ls.returncode == 0, ls.stderr
    assert "quickstart" in ls.stdout and "zero3-offload" in ls.stdout

    est = _zoff(installed, "estimate", "tiny", "zero=zero3", "--gpus-per-node", "2")
    assert est.returncode == 0, est.stderr
    assert "zero3" in est.stdout

    cp = _zoff(installed, "cp", "quickstart", "mine.yaml")
    assert cp.returncode == 0, cp.stderr
    assert (work / "mine.yaml").read_text().startswith("# zoff quickstart")

    run = _zoff(
        installed, "train", "tiny", "zero=zero3", "train.max_steps=5", "launch.nproc_per_node=2", "--run-dir", "run5",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "ZeRO stage 3" in run.stdout
    assert (work / "run5" / "metrics.jsonl").is_file()
