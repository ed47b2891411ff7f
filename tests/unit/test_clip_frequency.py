"""scripts/clip_frequency.py (issue 53's "how often the clip triggers"): its counting against the engine's own
clipping factor, and one tiny real run through `zoff train` whose recorded norms it reads back."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO_ROOT
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


def test_the_probes_norm_is_the_trainers_on_the_same_model_and_batch(tmp_path) -> None:
    """At a constant LR, a 7-step run's 7th step sees the model a 6-step run ends with and reads the stream's
    7th batch: the probe's norm of the 6-step run's checkpoint over that batch is the trainer's 7th norm."""
    cf = _script("clip_frequency")
    common = ["--warmup", "0", "--batch", "2", "--seq-len", "32", "--threads", "1", *TINY,
              "schedule.warmup_steps=0", "schedule.decay=constant"]  # fmt: skip
    seven = tmp_path / "seven"
    assert cf.main(["--steps", "7", "--noise-batches", "", "--keep-run", str(seven), *common,
                    "--json", str(tmp_path / "7.json")]) == 0  # fmt: skip
    assert not (seven / "checkpoints").exists()  # no probe, no checkpoint
    six = tmp_path / "six.json"
    assert (
        cf.main(["--steps", "6", "--noise-batches", "2,8", "--noise-draws", "3", *common, "--json", str(six)])
        == 0
    )
    noise = json.loads(six.read_text())["noise"]
    trainer = json.loads(tmp_path.joinpath("7.json").read_text())["norms"][6]
    assert noise["norms"]["2"][0] == pytest.approx(trainer, rel=1e-5)
    assert len(noise["norms"]["2"]) == 3 and len(noise["norms"]["8"]) == 3  # draws_for: 8 * 3 // 8 = 3
    assert noise["first_sequence"] == 12 and noise["probe_sequences"] == 3 * 2 + 3 * 8
    assert noise["fit"]["by_batch"]["8"]["draws"] == 3


def test_the_fit_recovers_the_mean_gradient_and_the_noise() -> None:
    """Norms that follow |g_B|^2 = |G|^2 + tr(S)/B exactly give back |G|^2 and tr(S), and B* where the RMS norm
    is the clip; each case without a B* says so, and a fitted |G|^2 below 0 gives B*'s lower bound."""
    gn = _script("gradient_noise")

    def norms(g2: float, trace: float) -> dict:
        return {b: [max(g2 + trace / b, 0.0) ** 0.5] * 2 for b in (2, 8, 32, 128)}

    f = gn.fit(norms(0.25, 30.0), clip=1.0, tokens_per_sequence=256)
    assert f["mean_sq_norm"] == pytest.approx(0.25) and f["noise_trace"] == pytest.approx(30.0)
    assert f["rms_under_clip_from_sequences"] == pytest.approx(30.0 / 0.75)
    assert f["rms_under_clip_from_tokens"] == pytest.approx(256 * 30.0 / 0.75)
    assert f["noise_scale"] == pytest.approx(120.0) and "B* of about **40 sequences" in gn.verdict(f, 1.0)
    above = gn.fit(norms(0.25, 30.0), clip=0.5, tokens_per_sequence=256)
    assert above["rms_under_clip_from_sequences"] is None and "no batch brings" in gn.verdict(above, 0.5)
    flat = gn.fit({2: [0.9, 0.9], 8: [0.9]}, clip=1.0, tokens_per_sequence=256)
    assert flat["rms_under_clip_from_sequences"] is None and "no noise term" in gn.verdict(flat, 1.0)
    rising = gn.fit({2: [0.5], 8: [0.9]}, clip=1.0, tokens_per_sequence=256)  # (noise, not a trend)
    assert rising["noise_trace"] < 0 and "no B*" in gn.verdict(rising, 1.0)
    negative = gn.fit({2: [3.0], 8: [1.0]}, clip=1.0, tokens_per_sequence=256)
    assert negative["mean_sq_norm"] < 0 and negative["noise_scale"] is None
    assert negative["rms_under_clip_from_sequences"] == pytest.approx(negative["noise_trace"])  # tr(S)/clip^2
    assert "at least" in gn.verdict(negative, 1.0)


def test_a_probe_batch_is_one_global_batch_of_its_micro_batches() -> None:
    """batch_norm over 4 micro-batches: the norm of one mean loss over their 8 sequences (the trainer's global
    batch), not of their sum or of one of them."""
    import torch

    gn = _script("gradient_noise")
    from zoff.config import load_config
    from zoff.data import GlobalBatches, load_corpus
    from zoff.models import build_model, lm_loss

    cfg = load_config(
        REPO_ROOT / "configs" / "quickstart.yaml", [*TINY, "data.seq_len=32", "model.seq_len=32"]
    )
    batches = GlobalBatches(load_corpus(cfg.data, 0), 32, 2, 1, 0, 1, 0)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    probe = gn.batch_norm(model, batches, range(5, 9))
    mbs = [batches.micro_batch_at(i, 0) for i in range(5, 9)]
    model.zero_grad()
    lm_loss(model(torch.cat([m.inputs for m in mbs])), torch.cat([m.targets for m in mbs])).backward()
    whole = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert probe == pytest.approx(float(whole), rel=1e-5)


def test_a_probe_that_cannot_run_is_refused_in_one_line(tmp_path, capsys) -> None:
    """Batch sizes that are not multiples of --batch: refused before any training; a run folder without a
    checkpoint: refused naming the folder, nothing written."""
    cf = _script("clip_frequency")
    out = tmp_path / "c.json"
    assert cf.main(["--batch", "2", "--noise-batches", "2,3", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--noise-batches 2,3: each size a positive multiple of --batch 2" in err
    rows = [{"step": s, "loss": 5.0, "step_time_s": 1.0, "grad_norm": 0.5} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        cf.main(["--from-run", str(tmp_path), "--warmup", "1", "--batch", "2", *TINY, "--json", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the gradient-noise probe:" in err and "--noise-batches ''" in err
    assert not out.exists()
    for args, why in [
        (["--noise-batches", "8"], "at least two sizes"),
        (["--noise-batches", "2,a"], "expected sizes in sequences"),
        (["--noise-draws", "0"], "--noise-draws 0: at least 1"),
        (["--steps", "200000", "--seq-len", "32", *TINY], "past the stream's first epoch"),
    ]:
        assert cf.main(["--batch", "2", *args, "--json", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err, (args, err)
    assert not out.exists()


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path, capsys) -> None:
    """--from-run on a run whose checkpoint holds another model than the arguments build: one line, exit 2,
    nothing written (not load_state_dict's traceback)."""
    cf = _script("clip_frequency")
    run, out = tmp_path / "run", tmp_path / "c.json"
    common = [
        "--steps",
        "3",
        "--warmup",
        "1",
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--threads",
        "1",
        "--noise-batches",
        "2,4",
    ]
    assert cf.main([*common, *TINY, "--keep-run", str(run), "--json", str(tmp_path / "a.json")]) == 0
    capsys.readouterr()
    other = ["model.n_layer=1", "model.n_head=2", "model.d_model=32"]
    assert cf.main([*common, *other, "--from-run", str(run), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its weights are not the model these arguments build" in err
    assert not out.exists()
