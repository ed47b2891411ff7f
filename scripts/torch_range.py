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
JSON = REPO / "docs" / "results" / "torch_range.json"
ROOT = Path("/var/tmp")
LOCK = ROOT / "zoff-torch-range.lock"
FREE_BYTES = 12 * 2**30  # a CUDA build of torch with its nvidia-* wheels is ~6 GB installed, plus the unpack

# The README's quickstart: "ends near loss 2.3 (val 2.4, from 5.35) after 300 steps".
README_QUICKSTART = {"final_loss": 2.3, "final_val_loss": 2.4}
QUICKSTART_TOLERANCE = 0.25  # another torch's kernels may move the last step's loss a little (none has yet)

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
WARNING = re.compile(r"(?P<path>/\S+?\.py):(?P<line>\d+): (?P<cat>\w*Warning): (?P<msg>.*)")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")


class BadInput(Exception):
    """One line for the user, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's usage block: one line instead, like zoff's CLI
        print(f"torch_range: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)


# ------------------------------------------------------------------------------------------ pure helpers
def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def pytest_counts(output: str) -> dict:
    """passed/failed/skipped/errors from pytest's closing line (the last line that counts anything)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for line in reversed(output.splitlines()):
        found = COUNT.findall(line)
        if found and re.search(r" in [\d.]+s", line):
            for n, what in found:
                key = "errors" if what.startswith("error") else what
                if key in counts:
                    counts[key] = int(n)
            break
    return counts


def first_failures(output: str, limit: int = 25) -> list[str]:
    """Node ids from pytest's -rfE short summary ("FAILED node - why", "ERROR node - why")."""
    ids = [m[2] for m in re.finditer(r"^(FAILED|ERROR) (\S+)", output, re.M)]
    return list(dict.fromkeys(ids))[:limit]


def zoff_warnings(text: str, src: Path) -> tuple[list[dict], list[dict]]:
    """Unique Deprecation/FutureWarnings in `text`: (those located in src/zoff/, those located elsewhere).
    A torch deprecation names its caller's line (stacklevel), so a zoff call to a deprecated API lands in
    the first list; the second keeps what torch or a library warns about inside itself, for the reader."""
    mine: dict[tuple, dict] = {}
    other: dict[tuple, dict] = {}
    root = str(src / "zoff") + os.sep
    for m in WARNING.finditer(text):
        if m["cat"] not in ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning"):
            continue
        path = m["path"]
        if path.startswith(root):
            where = f"zoff/{path[len(root) :]}:{m['line']}"
            mine.setdefault((where, m["msg"]), {"where": where, "category": m["cat"], "message": m["msg"]})
        else:
            short = path.split("site-packages/", 1)[-1]
            where = f"{short}:{m['line']}"
            other.setdefault((where, m["msg"]), {"where": where, "category": m["cat"], "message": m["msg"]})
    return list(mine.values()), list(other.values())[:10]


def merge(old: dict, entries: dict[str, dict]) -> dict:
    """The JSON with `entries` replacing those versions' entries; every other version kept."""
    versions = {**old.get("versions", {}), **entries}
    return {"versions": {v: versions[v] for v in sorted(versions, key=version_key)}}


def _cell(v: object) -> str:
    return str(v).replace("|", "\\|")


def _failures(e: dict) -> set[str] | None:
    """A version's failing and erroring tests; None where the suite did not finish or some went unnamed."""
    t = e.get("tests", {})
    if not t or t.get("timed_out") or t["failed"] + t["errors"] > len(t["first_failures"]):
        return None
    return set(t["first_failures"])


def common_failures(data: dict) -> set[str]:
    """Tests failing on every version that ran (at least two): the tree's failures, not a torch's."""
    sets = [_failures(e) for e in data.get("versions", {}).values() if e.get("tests")]
    return set.intersection(*sets) if len(sets) >= 2 and None not in sets else set()


def passed(data: dict) -> list[str]:
    """The releases checked: installed, the quickstart near the README's loss, and no failing test that the
    other versions pass (zoff/host/versions.py's TORCH_CHECKED_CPU holds these)."""
    common, out = common_failures(data), []
    for e in data.get("versions", {}).values():
        fails = _failures(e)
        if e["install"]["ok"] and e.get("quickstart", {}).get("near_readme") and fails is not None:
            if fails <= common:
                out.append(e["torch_version"].split("+")[0])
    return out


def render(data: dict) -> str:
    """A markdown table, one row per checked torch version, then its failures and zoff's warnings."""
    header = [
        "torch",
        "build",
        "Python",
        "install",
        "quickstart loss (val), s",
        "suite",
        "passed",
        "failed",
        "skipped",
        "errors",
        "tests, s",
        "zoff warnings",
        "result",
        "commit, date",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 6 + "---:|" * 6 + "---|---|"]
    notes = []
    good, common = passed(data), common_failures(data)
    for v, e in data.get("versions", {}).items():
        inst, qs, t = e.get("install", {}), e.get("quickstart", {}), e.get("tests", {})
        if qs.get("final_loss") is not None:
            near = "" if qs.get("near_readme") else ", not near the README's 2.3"
            loss = f"{qs['final_loss']:.2f} ({qs['final_val_loss']:.2f}), {qs['seconds']:.0f}{near}"
        else:
            loss = "failed" if qs else "not run"
        ran = bool(t)
        row = [
            e.get("torch_version", v),
            e.get("build", "?"),
            e.get("python", "?"),
            "ok" if inst.get("ok") else "failed",
            loss,
            e.get("suite", "?") + (" (timed out)" if t.get("timed_out") else ""),
            *(str(t.get(k, 0)) if ran else "-" for k in ("passed", "failed", "skipped", "errors")),
            f"{t['seconds']:.0f}" if ran else "-",
            str(len(e.get("warnings", []))),
            "pass" if e.get("torch_version", v).split("+")[0] in good else "FAIL",
            f"{e.get('commit', '?')}, {e.get('date', '?')[:10]}",
        ]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
        own = [n for n in t.get("first_failures", []) if n not in common]
        if own:
            notes.append(f"- {v} failures: " + ", ".join(f"`{n}`" for n in own))
        if not inst.get("ok") and inst.get("error"):
            notes.append(f"- {v} install: {_cell(inst['error'])}")
        for w in e.get("warnings", []):
            notes.append(f"- {v} warning: `{w['where']}` {w['category']}: {_cell(w['message'])}")
    if common:
        notes.insert(
            0,
            "- failing on every version (the commit's, not torch's; not held against a release): "
            + ", ".join(f"`{n}`" for n in sorted(common)),
        )
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


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


def pip_error(out: str) -> str:
    """What pip said went wrong: its conflict's lines (who asked for what), else its last ERROR line."""
    lines = [ln.strip() for ln in out.splitlines()]
    why = [ln for ln in lines if " depends on " in ln or ln.startswith("The user requested")]
    errors = [ln for ln in lines if ln.startswith("ERROR:") and "ResolutionImpossible" not in ln]
    return " / ".join(why[:3] or errors[-1:] or [tail(out, 2)])[:400]


def tail(text: str, n: int = 1) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " / ".join(lines[-n:])[:300]


def check_version(version: str, root: Path, suite: str, keep: bool, source: str = "head") -> dict:
    """Install torch `version` in its own venv, run the quickstart and the suite; the JSON entry."""
    home = root / f"zoff-torch-{version}"
    if home.exists():  # a --keep'd or interrupted run: start clean, an install is what is checked
        shutil.rmtree(home)
    free = shutil.disk_usage(root).free
    if free < FREE_BYTES:
        raise BadInput(f"{root}: {free / 2**30:.1f} GiB free, a torch venv needs ~{FREE_BYTES / 2**30:.0f}")
    src, venv, logs = home / "src", home / "venv", home / "logs"
    for d in (src, logs):
        d.mkdir(parents=True)
    entry: dict = {
        "torch": version,
        "suite": suite,
        "source": source,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    say = lambda msg: print(f"torch {version}: {msg}", flush=True)  # noqa: E731
    try:
        entry["commit"] = snapshot(src, source)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = str(venv / "bin" / "python")
        pins = home / "constraints.txt"
        pins.write_text(f"torch=={version}\n")
        # PIP_CONSTRAINT replaces any machine-wide constraint (one here caps torch below the newest release);
        # PATH and VIRTUAL_ENV make a test's `zoff` or `python` this venv's; ZOFF_CACHE_DIR keeps the CPU
        # Adam build and corpora inside the folder that is deleted afterwards.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(
            PIP_CONSTRAINT=str(pins),
            PIP_DISABLE_PIP_VERSION_CHECK="1",
            VIRTUAL_ENV=str(venv),
            PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            ZOFF_CACHE_DIR=str(home / "cache"),
        )

        say("installing torch (the CPU build if pip reaches one)")
        start = time.perf_counter()
        pip = [py, "-m", "pip", "install", "--no-cache-dir"]  # GBs of wheels: not kept in ~/.cache/pip
        code, out, _ = run([*pip, f"torch=={version}+cpu"], logs / "pip-torch-cpu.log", 1800, env=env)
        if code != 0:
            code, out, _ = run([*pip, f"torch=={version}"], logs / "pip-torch.log", 3600, env=env)
        if code == 0:
            probe = "import json, platform, torch; print(json.dumps([torch.__version__, torch.version.cuda, platform.python_version()]))"
            got, cuda, python = json.loads(
                subprocess.run([py, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
            )
            entry.update(
                torch_version=got, build=f"cu{cuda.replace('.', '')}" if cuda else "cpu", python=python
            )
            # `-e .[test]` may not replace the torch just installed. Pinned by release, not build: PyPI's
            # wheel says 2.12.0+cu130 inside but its file name has no +cu130, so pip finds no candidate
            # for ==2.12.0+cu130 and gives up; an installed torch that satisfies ==2.12.0 is left alone.
            pins.write_text(f"torch=={got.split('+')[0]}\n")
            say(f"installed {got}; installing zoff[test]")
            code, out, _ = run(
                [py, "-m", "pip", "install", "-e", f"{src}[test]"], logs / "pip-zoff.log", 1800, env=env
            )
        entry["install"] = {
            "ok": code == 0,
            "seconds": round(time.perf_counter() - start, 1),
            "venv_gib": round(sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30, 2),
            "error": None if code == 0 else pip_error(out),
        }  # fmt: skip
        entry.setdefault("python", platform.python_version())
        if code != 0:
            say(f"install failed: {entry['install']['error']}")
            return entry

        say("quickstart")
        qs_dir = home / "quickstart"
        qenv = {**env, "PYTHONWARNINGS": "default::DeprecationWarning,default::FutureWarning"}
        code, qs_out, secs = run(
            [py, "-m", "zoff", "train", "configs/quickstart.yaml", "--run-dir", str(qs_dir)],
            logs / "quickstart.log",
            1800,
            env=qenv,
            cwd=src,
        )
        summary = qs_dir / "summary.json"
        qs: dict = {"ok": code == 0 and summary.is_file(), "seconds": round(secs, 1)}
        if qs["ok"]:
            s = json.loads(summary.read_text())
            qs.update(
                final_loss=round(s["final_loss"], 4),
                final_val_loss=round(s["final_val_loss"], 4),
                first_loss=round(s["first_loss"], 4),
                near_readme=all(abs(s[k] - v) <= QUICKSTART_TOLERANCE for k, v in README_QUICKSTART.items()),
            )
        else:
            qs["error"] = "timed out" if code is None else tail(qs_out, 2)
        entry["quickstart"] = qs
        rank_logs = "".join(p.read_text(errors="replace") for p in qs_dir.rglob("*.log") if p.is_file())
        say(f"quickstart: {qs.get('final_loss', qs.get('error'))}; pytest --suite {suite}")

        args = [py, *PYTEST, *SUITES[suite]]
        code, t_out, secs = run(args, logs / "pytest.log", SUITE_TIMEOUT_S[suite], env=env, cwd=src)
        entry["tests"] = {
            "command": "python -m pytest -q" + "".join(f" {a}" for a in SUITES[suite]),
            **pytest_counts(t_out),
            "seconds": round(secs, 1),
            "exit_code": code,
            "timed_out": code is None,
            "first_failures": first_failures(t_out),
        }
        mine, other = zoff_warnings(t_out + qs_out + rank_logs, src)
        entry["warnings"], entry["warnings_elsewhere"] = mine, other
        t = entry["tests"]
        say(
            f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, {t['errors']} errors in {secs:.0f} s; {len(mine)} zoff warning(s)"
        )
        return entry
    finally:
        if keep:
            say(f"kept {home}")
        else:
            t = entry.get("tests", {})
            ok = entry.get("quickstart", {}).get("ok") and not (t.get("failed") or t.get("errors"))
            if not ok and logs.is_dir():  # the logs say why (a pip conflict, a traceback); the GBs go
                kept = root / f"zoff-torch-{version}-logs"
                shutil.rmtree(kept, ignore_errors=True)
                shutil.move(str(logs), kept)
                say(f"logs kept in {kept}")
            shutil.rmtree(home, ignore_errors=True)


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
