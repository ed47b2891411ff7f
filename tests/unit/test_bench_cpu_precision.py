"""The benchmarks on a CPU without fast 16-bit kernels (issue 52): where bf16 is slow here, each one that computes
in bf16 on the CPU either computes in fp32 (train.cpu_precision=fp32 in every run it measures, its floor's
included; the JSON's cpu_precision and the rendered table say so) or refuses in one line and exits 2;
--native-precision keeps bf16. Where bf16 is fast, nothing changes.

The host kind is forced both ways through ZOFF_MATMUL_FACTOR (zoff.host.kernels); no benchmark runs here: the
functions that would start runs are replaced by ones that record what they were asked to run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from tests.unit.test_bench_tables import _script
from zoff.host import kernels

benchlib = _script("benchlib")
SWITCH = "train.cpu_precision=fp32"


@pytest.fixture(params=["slow", "fast"])
def host(request, monkeypatch) -> str:
    """A host whose bf16 matmul is 137x fp32's (no AVX512), or as fast as fp32's."""
    monkeypatch.setenv(kernels.FACTOR_ENV, "bf16:137,fp16:90" if request.param == "slow" else "bf16:1,fp16:1")
    kernels.matmul_path.cache_clear()
    yield request.param
    kernels.matmul_path.cache_clear()


def slow_host(monkeypatch) -> None:
    monkeypatch.setenv(kernels.FACTOR_ENV, "bf16:137")
    kernels.matmul_path.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_probe():
    yield
    kernels.matmul_path.cache_clear()  # the next test's forced (or real) host


def test_the_plan_switches_to_fp32_only_where_bf16_is_slow(host: str) -> None:
    plan = benchlib.cpu_precision_plan("bench_x", "bf16", on_cpu=True)
    if host == "slow":
        assert (plan.computed, plan.overrides) == ("fp32", (SWITCH,))
        assert "137x" in plan.matmul and "reference kernel" in plan.matmul
    else:
        assert (plan.computed, plan.overrides, plan.matmul) == ("bf16", (), None)
    assert plan.to_json() == {"configured": "bf16", "computed": plan.computed, "matmul": plan.matmul}
    # fp32 runs, GPU ranks, and a config that computes in fp32 on its own are left as they are
    assert benchlib.cpu_precision_plan("bench_x", "fp32", on_cpu=True).overrides == ()
    assert benchlib.cpu_precision_plan("bench_x", "bf16", on_cpu=False).computed == "bf16"
    auto = benchlib.cpu_precision_plan("bench_x", "bf16", cpu_precision="auto", on_cpu=True)
    assert (auto.computed, auto.overrides) == ("fp32" if host == "slow" else "bf16", ())


def test_native_precision_keeps_bf16_and_says_so(monkeypatch) -> None:
    slow_host(monkeypatch)
    plan = benchlib.cpu_precision_plan(
        "bench_x", "bf16", native=True, refuse="pass --precision fp32", on_cpu=True
    )
    assert (plan.computed, plan.overrides) == ("bf16", ())
    note = benchlib.precision_note({"cpu_precision": plan.to_json()})
    assert "on purpose (--native-precision)" in note and "137x" in note


def test_the_refusal_is_one_line_naming_the_factor_and_the_flags(monkeypatch, capsys) -> None:
    slow_host(monkeypatch)
    with pytest.raises(SystemExit) as e:
        benchlib.cpu_precision_plan("bench_x", "bf16", refuse="pass --precision fp32", on_cpu=True)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_x: bf16 matmul on the CPU")
    assert "137x" in err and "--precision fp32" in err and "--native-precision" in err


def test_bench_deepspeed_refuses_bf16_on_a_slow_host(monkeypatch, capsys, tmp_path: Path) -> None:
    slow_host(monkeypatch)
    with pytest.raises(SystemExit) as e:
        _script("bench_deepspeed").main(["--out", str(tmp_path / "ds.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "137x" in err and "--precision fp32" in err and "--native-precision" in err
    )
    assert not (tmp_path / "ds.json").exists()


def test_bench_deepspeed_refuses_a_build_lock_a_killed_run_left(monkeypatch, capsys, tmp_path: Path) -> None:
    """A DeepSpeed worker killed while it loads its CPU Adam leaves torch's build lock: the next run would wait on
    it forever. The bench names the file in one line instead, before it starts anything."""
    ds = _script("bench_deepspeed")
    monkeypatch.setattr(ds, "VENV", tmp_path / "venv")
    monkeypatch.setattr(ds, "LOCK", tmp_path / "bench.lock")
    lock = tmp_path / "venv" / "torch_extensions" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    with pytest.raises(SystemExit) as e:
        ds.main(["--precision", "fp32", "--out", str(tmp_path / "ds.json")])
    assert str(lock) in str(e.value.code) and "remove it" in str(e.value.code)
    assert "\n" not in str(e.value.code) and lock.exists()  # (named, not removed: the user decides)
    assert not (tmp_path / "ds.json").exists()
    lock.unlink()
    assert ds.stale_build_locks() == []


def test_bench_offload_refuses_its_bf16_jobs_on_a_slow_host(monkeypatch, capsys, tmp_path: Path) -> None:
    slow_host(monkeypatch)
    with pytest.raises(SystemExit) as e:
        _script("bench_offload").main(["--precisions", "fp32,bf16", "--out", str(tmp_path / "o.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--precisions fp32" in err and "--native-precision" in err


def test_bench_beyond_memory_runs_and_floors_in_fp32_where_bf16_is_slow(host: str) -> None:
    bbm = _script("bench_beyond_memory")
    a = bbm.parser().parse_args(["--preset", "2g", "--size", "tiny", "train.seed=1"])
    overrides, cfg, cpu = bbm.planned_config(a, Console(quiet=True))
    if (
        host == "slow"
    ):  # after the line's overrides, before the preset's: the run's, the estimate's, the floor's
        assert overrides[-2:] == [SWITCH, bbm.BUDGET_2G]
        assert cfg.train.cpu_precision == "fp32" and cpu.computed == "fp32"
    else:
        assert SWITCH not in overrides and cpu.computed == "bf16"
    assert overrides == bbm.build_overrides(a, cpu.overrides)
    assert cfg.train.precision == cpu.configured == "bf16"


def test_the_floor_computes_in_fp32_where_bf16_is_slow(host: str, monkeypatch) -> None:
    floor = _script("offload_floor")
    runs: list[list[str]] = []

    def records(config: Path, overrides: list[str], who: str) -> list[dict]:
        runs.append(overrides)
        depth = int(next(o for o in overrides if o.startswith("model.n_layer=")).split("=")[1])
        return [{"step_time_s": float(depth), "forward_s": 0.1, "backward_s": 0.2}] * 3

    monkeypatch.setattr(floor, "train_records", records)
    out = floor.measure_compute(_script("bench_beyond_memory").DEFAULT_CONFIG, [], (2, 4), 3, 30)
    assert len(runs) == 4 and out["per_layer_s"] == 1.0
    assert all((SWITCH in run) == (host == "slow") for run in runs)
    assert out["cpu_precision"]["computed"] == ("fp32" if host == "slow" else "bf16")
    # a run that computes in fp32 already (the benchmark's own override) is measured as it is
    runs.clear()
    out = floor.measure_compute(_script("bench_beyond_memory").DEFAULT_CONFIG, [SWITCH], (2, 4), 3, 30)
    assert all(run.count(SWITCH) == 1 for run in runs) and out["cpu_precision"]["computed"] == "fp32"


def _fake_run(calls: list[list[str]]):
    def run(config: Path, overrides: list[str], steps: int) -> dict:
        calls.append(overrides)
        return {"step_s": 1.0, "step_times_s": [1.0] * steps, "walk_s": 0.5, "peak_rss_mib": 1024.0,
                "losses": [5.0] * steps}  # fmt: skip

    return run


def test_bench_overlap_switches_every_run_and_says_so(host: str, monkeypatch, tmp_path: Path) -> None:
    bo = _script("bench_overlap")
    calls: list[list[str]] = []
    monkeypatch.setattr(bo, "run", _fake_run(calls))
    out = tmp_path / "overlap.json"
    assert bo.main(["--rounds", "1", "--steps", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(calls) == 2 and all((SWITCH in c) == (host == "slow") for c in calls)
    assert data["cpu_precision"]["computed"] == ("fp32" if host == "slow" else "bf16")
    assert ("Computed in fp32 on the CPU, not bf16" in bo.render(data)) == (host == "slow")
    assert "--native-precision" not in data["command"]
    calls.clear()  # --native-precision: bf16 on purpose, recorded in the command
    assert bo.main(["--rounds", "1", "--steps", "4", "--json", str(out), "--native-precision"]) == 0
    assert not any(SWITCH in c for c in calls)
    assert "--native-precision" in json.loads(out.read_text())["command"]


def test_bench_vs_commit_trains_both_trees_in_fp32_where_bf16_is_slow(
    host: str, monkeypatch, tmp_path
) -> None:
    bvc = _script("bench_vs_commit")
    extras: list[tuple[str, ...]] = []

    def step_s(tree: Path, layers: int, steps: int, extra: tuple[str, ...] = ()) -> dict:
        extras.append(extra)
        return {"step_s": 1.0, "optimizer_s": 0.5, "losses": [5.0]}

    monkeypatch.setattr(bvc, "worktree", lambda rev: tmp_path)
    monkeypatch.setattr(bvc, "imports_from", lambda tree: str(tree.resolve()))
    monkeypatch.setattr(bvc, "step_s", step_s)
    out = tmp_path / "vs.json"
    assert bvc.main(["--rounds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # the base tree predates train.cpu_precision: both trees train in fp32 alike
    want = ("train.precision=fp32",) if host == "slow" else ()
    assert extras == [want, want] and data["overrides"] == [*bvc.OVERRIDES, *want]
    assert data["cpu_precision"]["computed"] == ("fp32" if host == "slow" else "bf16")


def _fake_demo(tree: Path, steps: int, extra: tuple[str, ...] = ()) -> dict:
    """A bench_beyond_memory result of `tree`: the base's step / floor 1.25, this tree's 1.30."""
    ratio = 1.30 if tree.name == "head" else 1.25
    return {"step_s": 100.0 * ratio, "floor_s": 100.0, "step_to_floor": ratio, "bound": "compute + CPU Adam",
            "losses": [6.0, 5.5], "peak_rss_job_bytes": 1, "disk_read_per_step": 2, "overrides": [*extra],
            "status": "ok"}  # fmt: skip


def test_bench_vs_commit_demo_compares_step_over_floor_and_keeps_each_round(monkeypatch, tmp_path) -> None:
    """--preset demo: each tree's own demo run in fp32, the ratio of step / floor, the JSON after every round
    (a later round's failure leaves the finished ones on disk)."""
    slow_host(monkeypatch)
    bvc = _script("bench_vs_commit")
    calls: list[tuple[str, tuple[str, ...]]] = []

    def demo_run(tree: Path, steps: int, extra: tuple[str, ...] = ()) -> dict:
        calls.append((tree.name, extra))
        if len(calls) > 2:
            raise SystemExit("the second round failed")
        return _fake_demo(tree, steps, extra)

    (tmp_path / "base").mkdir()
    (tmp_path / "head").mkdir()
    monkeypatch.setattr(bvc, "REPO", tmp_path / "head")
    monkeypatch.setattr(bvc, "worktree", lambda rev: tmp_path / "base")
    monkeypatch.setattr(bvc, "imports_from", lambda tree: str(tree.resolve()))
    real_config = bvc.load_config  # (this tree's demo: the fake trees hold no config)
    monkeypatch.setattr(bvc, "load_config", lambda path: real_config(benchlib.REPO / bvc.CONFIG))
    monkeypatch.setattr(bvc, "demo_run", demo_run)
    out = tmp_path / "demo.json"
    with pytest.raises(SystemExit, match="second round"):
        bvc.main(["--preset", "demo", "--rounds", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    assert calls[:2] == [("base", ("train.precision=fp32",)), ("head", ("train.precision=fp32",))]
    assert data["preset"] == "demo" and data["steps"] == 6 and len(data["rounds"]) == 1
    assert data["median_ratio"] == pytest.approx(1.30 / 1.25) and data["same_losses"]
    table = bvc.render(data)
    assert "| 1 | base then head | 125.0 | 100.0 | 1.250 | 130.0 | 100.0 | 1.300 | 1.040 | 1.040 |" in table
    assert "step / floor **1.040**" in table


def test_bench_vs_commit_demo_runs_each_trees_own_script(monkeypatch, tmp_path) -> None:
    """A tree that has speculation runs with it off (the base has none: the same work), and a run that measured
    no floor stops naming the tree."""
    bvc = _script("bench_vs_commit")
    cmds: list[list[str]] = []
    floor: dict = {"floor_s": 90.0, "step_to_floor": 1.2, "bound": "disk"}

    def run(cmd, cwd, env, **kw):
        cmds.append(cmd)
        assert cwd == tree and env["PYTHONPATH"] == str(tree)
        result = {"step_time_median_s": 108.0, "floor": floor, "steps": [{"loss": 6.0}],
                  "peak_rss_job_bytes": 1, "disk_io_per_step": {"ranks": {"read_per_step": 2}},
                  "overrides": [], "status": "ok"}  # fmt: skip
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(result))
        return bvc.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bvc.subprocess, "run", run)
    for knows in (True, False):
        tree = tmp_path / str(knows)
        (tree / "zoff" / "config").mkdir(parents=True)
        sections = (
            "    speculate: Literal['auto', True, False] = 'auto'\n" if knows else "    other: int = 1\n"
        )
        (tree / "zoff" / "config" / "sections.py").write_text(sections)
        got = bvc.demo_run(tree, 6, ("train.precision=fp32",))
        assert got["step_to_floor"] == 1.2 and got["losses"] == [6.0]
        assert cmds[-1][1:4] == ["scripts/bench_beyond_memory.py", "--steps", "6"]
        assert ("zero.offload_optimizer.speculate=false" in cmds[-1]) is knows
    floor = {}
    with pytest.raises(SystemExit, match=f"bench_vs_commit \\({tree}\\): the run measured no floor"):
        bvc.demo_run(tree, 6)


def test_renderings_of_json_without_the_field_are_unchanged() -> None:
    """JSONs measured before the field existed render as they did: no note, the configured precision."""
    data = {"date": "2026-01-01T00:00:00+00:00", "commit": "abc", "machine": {"cpu": "x"}, "command": "c"}
    assert benchlib.precision_note(data) == benchlib.computed_in(data) == ""
    assert benchlib.measured_line(data, "s").startswith("Measured ")
    switched = {
        **data,
        "cpu_precision": {"configured": "bf16", "computed": "fp32", "matmul": "bf16 matmul: 137x"},
    }
    assert benchlib.measured_line(switched, "s").startswith("Computed in fp32 on the CPU, not bf16: ")
    assert benchlib.computed_in(switched) == " (computed in fp32)"
    fast = {**data, "cpu_precision": {"configured": "bf16", "computed": "bf16", "matmul": None}}
    assert benchlib.measured_line(fast, "s") == benchlib.measured_line(data, "s")


def test_the_tables_name_what_was_computed() -> None:
    switched = {"configured": "bf16", "computed": "fp32", "matmul": "bf16 matmul on the CPU: 137x"}
    bbm = _script("bench_beyond_memory")
    r = json.loads(bbm.JSON.read_text())
    assert "bf16 (computed in fp32)" not in bbm.title(r) + bbm.render(r)
    r["cpu_precision"] = switched
    assert "bf16 (computed in fp32)" in bbm.title(r) and "bf16 (computed in fp32)" in bbm.render(r)
    io = _script("bench_io_contention")
    d = json.loads(io.JSON.read_text())
    assert "bf16 matmuls (256" in io.render(d)
    d["cpu_precision"] = switched
    assert "fp32 matmuls (256" in io.render(d) and "Computed in fp32 on the CPU" in io.render(d)


def test_every_benchmark_that_computes_bf16_on_the_cpu_has_the_flag() -> None:
    """--native-precision is the one way to keep a slow bf16 compute, in each script that checks."""
    for name in ("bench_beyond_memory", "bench_overlap", "bench_vs_commit", "bench_io_contention",
                 "bench_deepspeed", "bench_offload"):  # fmt: skip
        text = (benchlib.REPO / "scripts" / f"{name}.py").read_text()
        assert "cpu_precision_plan(" in text and "native_precision_arg(ap)" in text, name
