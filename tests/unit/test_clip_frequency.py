"""scripts/clip_frequency.py (issue 53's "how often the clip triggers"): its counting against the engine's own
clipping factor, and one tiny real run through `zoff train` whose recorded norms it reads back."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_bench_tables import _script
from zoff.engine.precision import clip_factor

TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=64"]


def test_a_step_is_unclipped_only_where_the_factor_is_exactly_one() -> None:
    """The 1e-6 of the engine's formula: a norm just under the clip still clips; counting `norm <= clip` would
    call it free and a speculated update there would not be the step."""
    cf = _script("clip_frequency")
    just_under = 1.0 - 5e-7
    assert just_under <= 1.0 and clip_factor(just_under, 1.0) < 1.0
    norms = [9.0, 8.0, 0.5, just_under, 0.2, 0.3, 3.0, 0.4, float("nan"), 0.1]
    f = cf.clip_figures(norms, clip=1.0, warmup=2, windows=2)
    free = [False, False, True, False, True, True, False, True, False, True]  # NaN clips (its factor is NaN)
    assert f["steps"] == 10 and f["after_warmup"] == 8 and f["unclipped_fraction"] == sum(free[2:]) / 8
    assert [(w["from_step"], w["to_step"], w["unclipped_fraction"]) for w in f["windows"]] == [
        (3, 6, 3 / 4), (7, 10, 2 / 4),
    ]  # fmt: skip
    # auto speculates steps 4, 6, 7, 9 (after 3, 5, 6, 8 were free) and commits 6 alone among those after warmup
    assert f["auto_speculated_fraction"] == 4 / 8 and f["auto_committed_fraction"] == 1 / 8
    assert f["auto_wasted_fraction"] == 3 / 8 and f["first_unclipped_step"] == 3
    with pytest.raises(SystemExit, match="none after the warmup's 10"):
        cf.clip_figures(norms, clip=1.0, warmup=10)


def test_a_tiny_run_reads_back_the_norms_the_trainer_recorded(tmp_path) -> None:
    """The run's own metrics.jsonl norms, the figures computed from them, the same from --from-run."""
    cf = _script("clip_frequency")
    out, run = tmp_path / "clip.json", tmp_path / "run"
    args = ["--steps", "6", "--warmup", "2", "--batch", "2", "--seq-len", "32", "--threads", "1", *TINY]
    assert cf.main([*args, "--keep-run", str(run), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    recorded = [r["grad_norm"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "grad_norm" in r and "event" not in r]  # fmt: skip
    assert data["norms"] == recorded and len(recorded) == 6
    assert data["figures"] == cf.clip_figures(recorded, 1.0, 2)
    assert 0.05 < data["params_m"] < 0.2  # the tiny model's, not the default 85M
    again = tmp_path / "again.json"
    assert cf.main([*args, "--from-run", str(run), "--json", str(again)]) == 0
    assert json.loads(again.read_text())["figures"] == data["figures"]
    assert "6 steps." in cf.render(data) and "| all 4 |" in cf.render(data)
    assert "GPT (1 layers x 64)" in cf.render(data)  # the model the run trained


def test_a_folder_that_is_not_a_run_is_refused_in_one_line(tmp_path, capsys) -> None:
    """--from-run on a folder without metrics.jsonl, or one whose records skip steps: exit 2, one line."""
    cf = _script("clip_frequency")
    assert cf.main(["--from-run", str(tmp_path), "--json", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--from-run {tmp_path}: no metrics.jsonl" in err
    rows = [{"step": s, "loss": 5.0, "step_time_s": 1.0, "grad_norm": 0.5} for s in (1, 2, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cf.main(["--from-run", str(tmp_path), "--warmup", "1", *TINY]) == 2
    assert "lacks steps" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
