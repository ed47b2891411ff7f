"""scripts/bench_finetune.py's table (docs/fine-tuning.md) is a pure function of its JSON: a small made-up
result renders every figure the page quotes, and the medians over rounds are taken per rank."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "scripts") not in sys.path:  # the script imports benchlib and beyond_memory_probe as siblings
    sys.path.insert(0, str(REPO / "scripts"))
_spec = importlib.util.spec_from_file_location("bench_finetune", REPO / "scripts" / "bench_finetune.py")
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)


def _round(wall: float, rss: dict[str, float], adapter: bool = False) -> dict:
    r = {
        "ranks": len(rss), "steps": 120, "first_loss": 7.3589, "final_loss": 4.2066, "final_val_loss": 4.2326,
        "val_losses": [[40, 5.3], [120, 4.2326]], "wall_s": wall, "train_time_s": wall - 14, "tokens_per_s": 5039.4,
        "peak_rss_mib": rss, "rank0_summary_peak_rss_mib": rss["rank0"], "checkpoint_bytes": 13_642_078,
        "loadavg_1min": [2.5, 3.5],
    }  # fmt: skip
    if adapter:
        r["adapter"] = {"convert_s": 2.0, "bytes": 611_563, "files": {}, "params": 149_504}
    return r


def _data() -> dict:
    sft = [_round(69.0, {"rank0": 475.2, "rank1": 471.0}), _round(90.0, {"rank0": 480.0, "rank1": 470.0}),
           _round(70.0, {"rank0": 476.0, "rank1": 499.0})]  # fmt: skip
    lora = [_round(76.0, {"rank0": 540.4}, adapter=True)]
    return {
        "date": "2026-11-26T08:53:11+00:00", "commit": "abc1234",
        "machine": {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu"},
        "command": "python scripts/bench_finetune.py --rounds 3", "rounds": 3, "base_params": 1_131_648,
        "recipes": {
            "llama-sft": {"config": "configs/llama-sft.yaml", "rounds": sft, "median": B.summarize(sft)},
            "llama-lora": {"config": "configs/llama-lora.yaml", "rounds": lora, "median": B.summarize(lora)},
        },
    }  # fmt: skip


def test_medians_are_per_rank_and_losses_are_compared() -> None:
    med = _data()["recipes"]["llama-sft"]["median"]
    assert med["wall_s"] == 70.0
    assert med["peak_rss_mib"] == {"rank0": 476.0, "rank1": 471.0}
    assert med["losses_same"]


def test_render_shows_the_figures_and_where_they_come_from() -> None:
    data = _data()
    before = copy.deepcopy(data)
    table = B.render(data)
    assert data == before, "render() changed its input"
    sft, lora = (ln for ln in table.splitlines() if ln.startswith("| `configs/"))
    assert "7.36 -> 4.21 (val 4.23)" in sft and "70 s (69-90), training 56 s" in sft and "5,039" in sft
    assert "476 / 471 MiB" in sft and "13.6 MB" in sft and sft.rstrip(" |").endswith("-")
    assert "540 MiB" in lora and "149,504 parameters, 0.61 MB" in lora
    assert "Medians of 3 rounds" in table and "1,131,648" in table
    last = table.rstrip("\n").splitlines()[-1]
    assert last.startswith("Measured 2026-11-26 08:53 UTC at commit abc1234 on AMD EPYC, 2 cores")
    assert last.endswith("`python scripts/bench_finetune.py --rounds 3`")


def test_the_json_is_where_render_docs_looks() -> None:
    assert B.JSON == REPO / "docs" / "results" / "bench_finetune.json"
