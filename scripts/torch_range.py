#!/usr/bin/env python
"""The torch versions zoff is checked on: each in a fresh venv, the quickstart and the tests, into one JSON.

    python scripts/torch_range.py 2.16.0                       # the next release: quick suite, venv deleted
    python scripts/torch_range.py 2.12.0 2.15.0 --suite quick  # several, one after the other
    python scripts/torch_range.py 2.15.0 --suite default --keep
    python scripts/torch_range.py 2.16.0 --source tree         # with this tree's uncommitted changes
    python scripts/torch_range.py --render                     # the table from the JSON, nothing run

For each VERSION, in /var/tmp/zoff-torch-VERSION (a real disk: never tmpfs, never inside the repo):
  1. a copy of the sources: HEAD's files (`git archive`; the JSON records the commit), or with --source
     tree the work tree's tracked and untracked-but-not-ignored files ("+dirty" where they differ). HEAD is
     the default: in a tree others edit, a half-made change of theirs would fail the suite, not torch;
  2. a venv with torch==VERSION, the CPU build where pip can reach one (torch==VERSION+cpu), else the
     registry's default build (CUDA on Linux x86_64, which runs on the CPU too); then `pip install -e
     .[test]` under a constraint pinning the torch just installed, so no dependency can swap it;
  3. the quickstart, `python -m zoff train configs/quickstart.yaml`, and its summary.json (final loss
     against the README's "near loss 2.3 (val 2.4)");
  4. the tests: --suite default is the README's `python -m pytest -q -n 2 --dist loadfile` (about 13 minutes
     on 2 cores);
     --suite quick is tests/unit plus QUICK_SLICE (the engine at stages 0-3 on 2 ranks, a bit-exact resume,
     offload, the compiled CPU Adam, the real launcher and its stop signals);
  5. the Deprecation- and FutureWarnings whose location is in zoff/ (pytest's warnings summary, and the
     quickstart's ranks run with PYTHONWARNINGS showing both; a warning printed inside a spawned rank
     during a test is pytest-captured and not seen).
The venv is deleted afterwards (--keep keeps it); a version that failed keeps its logs in
/var/tmp/zoff-torch-VERSION-logs. Each version's entry in docs/results/torch_range.json is replaced as soon as it finishes; the others stay.
zoff/host/versions.py states the checked range the docs and `zoff doctor` show: update it after a new version.
One run at a time (a lock under /var/tmp): the installs are multi-GB and the suites want both cores.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "scripts") not in sys.path:  # the tests load this file by path, without scripts/ on sys.path
    sys.path.insert(0, str(REPO / "scripts"))

# The reading half (what pip, pytest and the quickstart printed or wrote; the JSON merged; the table) is
# torch_range_report.py. passed(), pytest_counts() and first_failures() are imported here too (F401), where
# the tests have always found them.
from torch_range_report import (  # noqa: E402, F401
    first_failures,
    merge,
    passed,
    pip_error,
    pytest_counts,
    quickstart_result,
    render,
    suite_result,
    tail,
    zoff_warnings,
)

JSON = REPO / "docs" / "results" / "torch_range.json"
ROOT = Path("/var/tmp")
LOCK = ROOT / "zoff-torch-range.lock"
FREE_BYTES = 12 * 2**30  # a CUDA build of torch with its nvidia-* wheels is ~6 GB installed, plus the unpack

# Fast, but each touches what a torch release can break: the engine at stages 0-3 over 2 gloo ranks against
# plain PyTorch, a bit-exact resume, CPU offload, the CPU Adam extension compiled against this torch's
# headers, and the elastic launcher (the torch API zoff leans on most) with its stop signals.
QUICK_SLICE = [
    *[
        f"tests/integration/test_engine_equivalence.py::test_stage_matches_reference[2-ranks-{s}]"
        for s in range(4)
    ],
    "tests/integration/test_engine_equivalence.py::test_bucketed_reduction_equals_direct[2-ranks]",
    "tests/integration/test_engine_equivalence.py::test_user_model_with_tied_frozen_and_reused_modules",
    "tests/integration/test_checkpoint.py::test_resume_is_bit_exact",
    "tests/integration/test_offload.py",
    "tests/integration/test_cpu_adam.py",
    "tests/integration/test_train_cli.py",
    "tests/integration/test_stop_messages.py",
]
# default: the README's `pytest -q -n 2 --dist loadfile` (both cores, a file's tests on one worker)
SUITES = {"quick": ["tests/unit", *QUICK_SLICE], "default": ["-n", "2", "--dist", "loadfile"]}
SUITE_TIMEOUT_S = {"quick": 40 * 60, "default": 90 * 60}
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "-W", "default"]

VERSION = re.compile(r"\d+\.\d+\.\d+")


class BadInput(Exception):
    """One line for the user, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's usage block: one line instead, like zoff's CLI
        print(f"torch_range: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------------------- the machinery
def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout
    except OSError:
        return ""


def snapshot(dest: Path, source: str) -> str:
    """Copy the sources to `dest`; the commit they are: HEAD's short hash, "+dirty" for a work tree whose
    tracked files outside docs/ and *.md differ from it (benchlib's rule)."""
    head = git("rev-parse", "HEAD").strip()
    if not head:
        raise BadInput(f"{REPO} is not a git work tree (the sources are copied with git)")
    if source == "head":
        # the hash read once: a commit landing meanwhile changes neither the files nor what the JSON says
        tar = subprocess.run(
            ["git", "archive", "--format=tar", head], cwd=REPO, capture_output=True, check=True
        )
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
            t.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return head[:7]
    for rel in filter(None, git("ls-files", "-z", "-c", "-o", "--exclude-standard").split("\0")):
        src = REPO / rel
        if not src.exists() and not src.is_symlink():  # deleted but still tracked
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel, follow_symlinks=False)
    dirty = git(
        "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs", ":(exclude)*.md"
    )
    return head[:7] + ("+dirty" if dirty.strip() else "")


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (/proc/mounts' longest matching mount point)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            point, typ = line.split()[1:3]
            if str(path).startswith(point.rstrip("/") + "/") or str(path) == point:
                if len(point) > len(best):
                    best, kind = point, typ
    except OSError:
        pass
    return kind


def check_root(root: Path) -> None:
    root = root.resolve()
    if not root.is_dir():
        raise BadInput(f"--root {root}: no such folder")
    if root == REPO or REPO in root.parents:
        raise BadInput(
            f"--root {root} is inside the repository (the snapshot and venvs would copy themselves)"
        )
    if fs_type(root) in ("tmpfs", "ramfs"):
        raise BadInput(f"--root {root} is {fs_type(root)}: a torch venv is GBs of RAM there; use a real disk")


def run(cmd: list[str], log: Path, timeout: float, **kw) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, output, seconds); output also goes to `log`. Its own process group,
    so a timeout ends the ranks and compilers it started too."""
    start = time.perf_counter()
    with log.open("w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        try:
            code: int | None = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            code = None
        except BaseException:  # Ctrl-C: the child has its own session, so it would outlive this script
            os.killpg(p.pid, 9)
            raise
    return code, log.read_text(errors="replace"), time.perf_counter() - start


class Home:
    """ROOT/zoff-torch-VERSION, where one release is checked: the sources, the venv and its torch pin, the logs,
    and the environment every step runs in."""

    def __init__(self, root: Path, version: str) -> None:
        self.root, self.version = root, version
        self.path = root / f"zoff-torch-{version}"
        self.src, self.venv, self.logs = self.path / "src", self.path / "venv", self.path / "logs"
        self.py = str(self.venv / "bin" / "python")
        self.pins = self.path / "constraints.txt"
        self.env = venv_env(self.venv, self.pins, self.path / "cache")

    def say(self, msg: str) -> None:
        print(f"torch {self.version}: {msg}", flush=True)

    def start_clean(self) -> None:
        """An empty folder for the sources and the logs, on a disk with room for a venv."""
        if self.path.exists():  # a --keep'd or interrupted run: start clean, an install is what is checked
            shutil.rmtree(self.path)
        free = shutil.disk_usage(self.root).free
        if free < FREE_BYTES:
            raise BadInput(
                f"{self.root}: {free / 2**30:.1f} GiB free, a torch venv needs ~{FREE_BYTES / 2**30:.0f}"
            )
        for d in (self.src, self.logs):
            d.mkdir(parents=True)

    def clean_up(self, entry: dict, keep: bool) -> None:
        """The folder deleted (--keep keeps it); a version that failed keeps its logs beside it."""
        if keep:
            self.say(f"kept {self.path}")
            return
        t = entry.get("tests", {})
        ok = entry.get("quickstart", {}).get("ok") and not (t.get("failed") or t.get("errors"))
        if not ok and self.logs.is_dir():  # the logs say why (a pip conflict, a traceback); the GBs go
            kept = self.root / f"zoff-torch-{self.version}-logs"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.move(str(self.logs), kept)
            self.say(f"logs kept in {kept}")
        shutil.rmtree(self.path, ignore_errors=True)


def venv_env(venv: Path, pins: Path, cache: Path) -> dict[str, str]:
    """This process's environment, made the venv's for pip, the quickstart and the tests."""
    # PIP_CONSTRAINT replaces any machine-wide constraint (one here caps torch below the newest release);
    # PATH and VIRTUAL_ENV make a test's `zoff` or `python` this venv's; ZOFF_CACHE_DIR keeps the CPU
    # Adam build and corpora inside the folder that is deleted afterwards.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        PIP_CONSTRAINT=str(pins),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        ZOFF_CACHE_DIR=str(cache),
    )
    return env


def install(home: Home, entry: dict) -> bool:
    """A venv with torch, then zoff[test] under a pin of the torch installed; entry's build, python and install
    fields. False where pip failed."""
    subprocess.run([sys.executable, "-m", "venv", str(home.venv)], check=True)
    home.pins.write_text(f"torch=={home.version}\n")
    home.say("installing torch (the CPU build if pip reaches one)")
    start = time.perf_counter()
    code, out = install_torch(home)
    if code == 0:
        got = installed_torch(home, entry)
        # `-e .[test]` may not replace the torch just installed. Pinned by release, not build: PyPI's
        # wheel says 2.12.0+cu130 inside but its file name has no +cu130, so pip finds no candidate
        # for ==2.12.0+cu130 and gives up; an installed torch that satisfies ==2.12.0 is left alone.
        home.pins.write_text(f"torch=={got.split('+')[0]}\n")
        home.say(f"installed {got}; installing zoff[test]")
        zoff = [home.py, "-m", "pip", "install", "-e", f"{home.src}[test]"]
        code, out, _ = run(zoff, home.logs / "pip-zoff.log", 1800, env=home.env)
    entry["install"] = {
        "ok": code == 0,
        "seconds": round(time.perf_counter() - start, 1),
        "venv_gib": round(sum(f.stat().st_size for f in home.venv.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30, 2),
        "error": None if code == 0 else pip_error(out),
    }  # fmt: skip
    entry.setdefault("python", platform.python_version())
    if code != 0:
        home.say(f"install failed: {entry['install']['error']}")
    return code == 0


def install_torch(home: Home) -> tuple[int | None, str]:
    """pip's torch==VERSION+cpu, else the registry's default build: (pip's exit code, what it printed)."""
    pip = [home.py, "-m", "pip", "install", "--no-cache-dir"]  # GBs of wheels: not kept in ~/.cache/pip
    code, out, _ = run(
        [*pip, f"torch=={home.version}+cpu"], home.logs / "pip-torch-cpu.log", 1800, env=home.env
    )
    if code != 0:
        code, out, _ = run([*pip, f"torch=={home.version}"], home.logs / "pip-torch.log", 3600, env=home.env)
    return code, out


def installed_torch(home: Home, entry: dict) -> str:
    """The torch the venv holds: its version, build and Python into `entry`; the version."""
    probe = "import json, platform, torch; print(json.dumps([torch.__version__, torch.version.cuda, platform.python_version()]))"
    got, cuda, python = json.loads(
        subprocess.run(
            [home.py, "-c", probe], capture_output=True, text=True, env=home.env, check=True
        ).stdout
    )
    entry.update(torch_version=got, build=f"cu{cuda.replace('.', '')}" if cuda else "cpu", python=python)
    return got


def quickstart(home: Home, entry: dict) -> str:
    """configs/quickstart.yaml trained in the venv; entry["quickstart"]: its losses against the README's.
    Returns what it and its ranks printed (their warnings count too)."""
    home.say("quickstart")
    qs_dir = home.path / "quickstart"
    qenv = {**home.env, "PYTHONWARNINGS": "default::DeprecationWarning,default::FutureWarning"}
    train = [home.py, "-m", "zoff", "train", "configs/quickstart.yaml", "--run-dir", str(qs_dir)]
    code, qs_out, secs = run(train, home.logs / "quickstart.log", 1800, env=qenv, cwd=home.src)
    entry["quickstart"] = quickstart_result(code, qs_out, secs, qs_dir / "summary.json")
    rank_logs = "".join(p.read_text(errors="replace") for p in qs_dir.rglob("*.log") if p.is_file())
    return qs_out + rank_logs


def check_version(version: str, root: Path, suite: str, keep: bool, source: str = "head") -> dict:
    """Install torch `version` in its own venv, run the quickstart and the suite; the JSON entry."""
    home = Home(root, version)
    home.start_clean()
    entry: dict = {
        "torch": version,
        "suite": suite,
        "source": source,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    try:
        entry["commit"] = snapshot(home.src, source)
        if not install(home, entry):
            return entry
        qs_out = quickstart(home, entry)
        qs = entry["quickstart"]
        home.say(f"quickstart: {qs.get('final_loss', qs.get('error'))}; pytest --suite {suite}")
        pytest = [home.py, *PYTEST, *SUITES[suite]]
        code, t_out, secs = run(
            pytest, home.logs / "pytest.log", SUITE_TIMEOUT_S[suite], env=home.env, cwd=home.src
        )
        entry["tests"] = suite_result(code, t_out, secs, SUITES[suite])
        mine, other = zoff_warnings(t_out + qs_out, home.src)
        entry["warnings"], entry["warnings_elsewhere"] = mine, other
        t = entry["tests"]
        home.say(
            f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, {t['errors']} errors in {secs:.0f} s; {len(mine)} zoff warning(s)"
        )
        return entry
    finally:
        home.clean_up(entry, keep)


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="*", metavar="VERSION", help="torch releases, e.g. 2.15.0")
    ap.add_argument(
        "--suite", choices=sorted(SUITES), default="quick", help="quick (default) or the README's"
    )
    ap.add_argument(
        "--source", choices=["head", "tree"], default="head", help="HEAD's files (default) or the work tree's"
    )
    ap.add_argument("--keep", action="store_true", help="keep each /var/tmp/zoff-torch-VERSION afterwards")
    ap.add_argument(
        "--root", type=Path, default=ROOT, help="where the venvs go (a real disk; default /var/tmp)"
    )
    ap.add_argument("--render", action="store_true", help="print the table from the JSON; run nothing")
    a = ap.parse_args(argv)
    try:
        if a.render:
            if not JSON.is_file():
                raise BadInput(f"{JSON}: no results yet")
            sys.stdout.write(render(json.loads(JSON.read_text())))
            return 0
        if not a.versions:
            raise BadInput("name at least one torch version, e.g. 2.16.0")
        bad = [v for v in a.versions if not VERSION.fullmatch(v)]
        if bad:
            raise BadInput(f"{bad[0]}: not a torch release number like 2.15.0")
        check_root(a.root)
        lock = (a.root / LOCK.name).open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BadInput(f"another torch_range run holds {lock.name} in {a.root}: one at a time") from None
        for v in dict.fromkeys(a.versions):
            entry = check_version(v, a.root.resolve(), a.suite, a.keep, a.source)
            old = json.loads(JSON.read_text()) if JSON.is_file() else {}
            JSON.write_text(json.dumps(merge(old, {v: entry}), indent=2) + "\n")
            print(f"torch {v}: wrote {JSON.relative_to(REPO)}", flush=True)
    except BadInput as e:
        print(f"torch_range: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
