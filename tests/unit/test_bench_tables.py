"""Every benchmark script renders its markdown table(s) from its JSON under docs/results/ (scripts/bench_*.py,
render() and --render): the JSON says when, at which commit and on what it was measured, the rendering is a pure
function of the JSON, and a number the table shows reaches the text. The docs pages embed these renderings."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _bump_nvme(d: dict) -> None:
    for r in d["rounds"]:  # every round: the table shows medians over rounds
        r["dd"]["write"] += 1.0


# script -> a change to one number its table shows
CHANGES: dict[str, Callable[[dict], None]] = {
    "bench_engine": lambda d: d["timing"]["vs_ddp"].update(zoff2=d["timing"]["vs_ddp"]["zoff2"] + 0.5),
    "bench_adam": lambda d: d["results"][0]["rows"]["zoff CPUAdam"].update(ms_per_step=1e3),
    "bench_offload": lambda d: d["jobs"][0]["summary"]["variants"]["offload"].update(ms_per_step=1e6),
    "bench_checkpoint": lambda d: d["summary"]["variants"]["zoff"].update(save_s=1e3),
    "bench_nvme": _bump_nvme,
    "bench_beyond_memory": lambda d: d.update(peak_rss_job_bytes=d["peak_rss_job_bytes"] + 2**30),
    "gpu_activation_check": lambda d: d["results"][0].update(
        measured_peak=2 * d["results"][0]["measured_peak"]
    ),
}


def _script(name: str):
    if str(SCRIPTS) not in sys.path:  # the scripts import benchlib and their helpers as siblings
        sys.path.insert(0, str(SCRIPTS))
    if name in sys.modules:  # the scripts import one another (benchlib) by these names
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before exec: dataclasses look their module up there (bench_engine's Variant)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_the_table_is_rendered_from_the_json(name: str) -> None:
    mod = _script(name)
    assert mod.JSON == REPO / "docs" / "results" / f"{name}.json"
    data = json.loads(mod.JSON.read_text())
    for key in ("date", "commit", "machine"):
        assert data.get(key), f"{name}: no {key}"
    assert data["machine"].get("cpu"), name

    before = copy.deepcopy(data)
    table = mod.render(data)
    assert data == before, f"{name}: render() changed its input"
    assert mod.render(copy.deepcopy(data)) == table, f"{name}: render() is not deterministic"
    last = table.rstrip("\n").splitlines()[-1]
    assert last.startswith("Measured ") and f"at commit {data['commit']} on " in last, last
    assert f"`python scripts/{name}.py" in last, last
    assert "|---" in table

    changed = copy.deepcopy(data)
    CHANGES[name](changed)
    assert mod.render(changed) != table, f"{name}: the changed number does not reach the table"


def test_render_without_a_json_says_so(tmp_path: Path, capsys) -> None:
    benchlib = _script("benchlib")
    assert benchlib.print_rendered(tmp_path / "missing.json", lambda d: "table") == 2
    assert "missing.json" in capsys.readouterr().out


def test_the_recorded_command_names_the_preset_not_its_json(tmp_path) -> None:
    """The recorded command reproduces a run into the same JSON: a preset's own JSON follows from its
    --preset, which the command keeps; the output path is left out."""
    import argparse

    benchlib = _script("benchlib")
    presets = {
        "default": benchlib.Preset(benchlib.RESULTS / "bench_overlap.json"),
        "offload": benchlib.Preset(benchlib.RESULTS / "bench_overlap_offload.json", ("model.n_layer=6",)),
    }
    ap = argparse.ArgumentParser()
    benchlib.preset_args(ap, presets)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    own = ap.parse_args(["--steps", "5", "train.seed=1"])
    assert benchlib.resolve_output(own, presets) is presets["default"]
    assert own.out == benchlib.RESULTS / "bench_overlap.json"
    assert (
        benchlib.command_line(ap, own, "bench_overlap")
        == "python scripts/bench_overlap.py --steps 5 train.seed=1"
    )
    other = ap.parse_args(["--preset", "offload", "--steps", "5"])
    assert benchlib.resolve_output(other, presets).overrides == ("model.n_layer=6",)
    assert other.out == benchlib.RESULTS / "bench_overlap_offload.json"
    assert benchlib.command_line(ap, other, "bench_overlap") == (
        "python scripts/bench_overlap.py --preset offload --steps 5"
    )
    elsewhere = ap.parse_args(["--preset", "offload", "--json", str(tmp_path / "x.json")])
    benchlib.resolve_output(elsewhere, presets)
    assert elsewhere.out == tmp_path / "x.json"
    assert (
        benchlib.command_line(ap, elsewhere, "bench_overlap")
        == "python scripts/bench_overlap.py --preset offload"
    )


# script -> {preset: the JSON under docs/results/ it writes} (the names the docs' history was recorded under)
PRESET_JSONS = {
    "bench_beyond_memory": {
        "default": "bench_beyond_memory", "2g": "bench_beyond_memory_2g",
        "dpu": "bench_beyond_memory_dpu", "dpu-2g": "bench_beyond_memory_dpu_2g",
        "unclipped": "bench_beyond_memory_unclipped", "unclipped-2g": "bench_beyond_memory_unclipped_2g",
    },
    "bench_overlap": {"default": "bench_overlap", "offload": "bench_overlap_offload"},
    "bench_vs_commit": {"default": "bench_vs_commit", "demo": "bench_vs_commit_demo"},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PRESET_JSONS))
def test_each_preset_maps_to_its_own_json(name: str) -> None:
    mod = _script(name)
    want = {v: REPO / "docs" / "results" / f"{j}.json" for v, j in PRESET_JSONS[name].items()}
    assert {v: x.json for v, x in mod.PRESETS.items()} == want
    assert mod.JSON == mod.PRESETS["default"].json  # what the bare script writes
    for v, x in mod.PRESETS.items():
        data = json.loads(x.json.read_text())
        flag = "" if v == "default" else f" --preset {v}"
        assert data["command"].startswith(f"python scripts/{name}.py{flag}"), (v, data["command"])
        assert all(o in data["overrides"] for o in x.overrides), v  # what the run was given


def test_a_preset_of_bench_beyond_memory_adds_its_overrides_after_the_command_lines() -> None:
    bbm = _script("bench_beyond_memory")
    ap = bbm.parser()
    a = ap.parse_args(["--preset", "dpu-2g", "--steps", "6", "zero.offload_optimizer.host_budget=8GiB"])
    bbm.benchlib.resolve_output(a, bbm.PRESETS)
    assert a.out == bbm.PRESETS["dpu-2g"].json
    overrides = bbm.build_overrides(a)
    assert overrides[-4:] == [
        "zero.offload_optimizer.host_budget=8GiB", "zero.offload_optimizer.overlap_step=false",
        "zero.offload_optimizer.delay_update=true", "zero.offload_optimizer.host_budget=2GiB",
    ]  # fmt: skip
    assert bbm.benchlib.command_line(ap, a, "bench_beyond_memory") == (
        "python scripts/bench_beyond_memory.py --preset dpu-2g --steps 6 zero.offload_optimizer.host_budget=8GiB"
    )


def test_the_deepspeed_table_says_the_regime_each_side_ran_in() -> None:
    """Each side's norms against the clip (the engine's factor: a norm 4e-7 under the clip still clips) and what
    zoff's speculation committed; a JSON measured before norms were recorded renders no such line."""
    report = _script("deepspeed_report")
    norms = [2.0, 0.5, 1.0 - 4e-7]
    s = {
        "norms": {"zoff": norms, "deepspeed": norms[:2]},
        "speculation": {"committed_units": 3, "speculated_units": 4},
    }
    line = report.clip_line("the pair", s, 1.0)
    assert (
        "zoff's norms 0.5-2, clipped at 2 of 3 steps, DeepSpeed's norms 0.5-2, clipped at 1 of 2 steps"
        in line
    )
    assert "committed 3 of 4 units" in line
    assert "speculated nothing" in report.clip_line("the pair", {**s, "speculation": None}, 1.0)
    assert report.clip_line("the pair", {}, 1.0) == ""
