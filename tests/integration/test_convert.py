"""`zoff convert` through the real CLI: exact keys and logits, dtypes, sharded output, bounded memory, bad input.

Each CLI call is its own `python -m zoff convert` process. A fresh interpreter spends seconds importing torch
on 2 loaded cores, so one call of each group starts one and the others are forked from a server that has
imported zoff and torch once (tests.forked_zoff); the calls of a group run concurrently (`_zoff_many`) and the
tests inspect their recorded results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.forked_zoff import forked_cli
from tests.harness import run_zoff, tiny_cfg
from zoff.config import config_from_dict
from zoff.models import build_model

pytestmark = pytest.mark.slow  # real ranks over gloo and a dozen CLI subprocesses

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
BAD_INPUT_CASES = (
    "missing-checkpoint", "existing-out", "dtype-fp8", "format-xyz", "shard-size-banana",
    "truncated-shard", "flipped-bytes", "missing-manifest", "out-dir-missing",
)  # fmt: skip


# ------------------------------------------------------------------------------------------ helpers
def _env() -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _zoff_many(
    calls: dict[str, list[str]], fresh: str, timeout: float = 240
) -> dict[str, subprocess.CompletedProcess]:
    """Run `python -m zoff convert ARGS` for every entry at once; return each finished process by its key.
    The call keyed `fresh` runs in a new interpreter, the others are forked from the tests' fork server."""
    env = _env()
    p = subprocess.Popen(
        [sys.executable, "-m", "zoff", "convert", *map(str, calls[fresh])],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        forked = [key for key in calls if key != fresh]
        results = forked_cli([(["convert", *calls[key]], REPO, env) for key in forked], timeout)
        done = dict(zip(forked, results))
        out, err = p.communicate(timeout=timeout)  # a hung convert fails the test, not the suite
        done[fresh] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return {key: done[key] for key in calls}


def _ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    return p


def _model(cfg: dict) -> torch.nn.Module:
    torch.manual_seed(123)  # a different init than the run's: every value must come from the loaded state
    return build_model(config_from_dict(cfg).model).eval()


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def _logits(cfg: dict, state: dict[str, torch.Tensor]) -> torch.Tensor:
    model = _model(cfg)
    model.load_state_dict(state, strict=True)
    return model(_batch())


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A 2-rank stage-3 run of the tied-embedding GPT, 3 steps, its checkpoint and its gathered fp32 params."""
    root = tmp_path_factory.mktemp("convert-run")
    cfg = tiny_cfg(
        zero={"stage": 3, "param_persistence_threshold": 64, "reduce_bucket_size": 3000},
        train={"max_steps": 3, "grad_accum": 1},
        checkpoint={"dir": str(root / "ck"), "every_steps": 3},
    )
    assert cfg["model"].get("tie_embeddings", True)
    result = run_zoff(cfg, 2, root)
    params = result[0]["params"]
    assert "lm_head.weight" in params and torch.equal(params["lm_head.weight"], params["wte.weight"])
    manifest = json.loads((root / "ck" / "step_00000003" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["zero_stage"]) == (2, 3)
    split = [p for p in manifest["params"] if len({piece["file"] for piece in p["pieces"]}) > 1]
    assert split, "some parameter must be split across both ranks' shards: convert has to merge it"
    return {"cfg": cfg, "dir": root / "ck", "step": root / "ck" / "step_00000003", "params": params}


@pytest.fixture(scope="module")
def converted(trained, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("converted")
    step, ckdir = trained["step"], trained["dir"]
    calls = {
        "fp32": [step, out / "fp32.safetensors"],
        "bf16": [ckdir, out / "bf16.safetensors", "--dtype", "bf16"],  # a checkpoint dir: its latest
        "sharded": [step, out / "sharded", "--max-shard-size", "40KB"],
        "pt": [step, out / "model.pt", "--format", "pt"],
        "pt-sharded": [step, out / "pt-sharded", "--format", "pt", "--max-shard-size", "40KB"],
    }
    results = _zoff_many(calls, fresh="fp32")
    return {"out": out, "results": results}


# ------------------------------------------------------------------------------------------ (a) exactness
def test_fp32_output_has_exact_keys_and_reproduces_the_trained_logits(trained, converted) -> None:
    _ok(converted["results"]["fp32"])
    sd = load_file(str(converted["out"] / "fp32.safetensors"))
    model = _model(trained["cfg"])
    assert set(sd) == set(model.state_dict())  # tied lm_head.weight present, nothing extra
    assert "lm_head.weight" in sd and torch.equal(sd["lm_head.weight"], sd["wte.weight"])
    model.load_state_dict(sd, strict=True)
    for name, p in trained["params"].items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], p), name
    got, want = _logits(trained["cfg"], sd), _logits(trained["cfg"], trained["params"])
    assert torch.equal(got, want)


def test_bf16_output_equals_the_rounded_model(trained, converted) -> None:
    _ok(converted["results"]["bf16"])
    sd = load_file(str(converted["out"] / "bf16.safetensors"))
    assert set(sd) == set(_model(trained["cfg"]).state_dict())
    assert all(t.dtype == torch.bfloat16 for t in sd.values()), {k: t.dtype for k, t in sd.items()}
    rounded = {k: p.to(torch.bfloat16).float() for k, p in trained["params"].items()}
    for k, t in sd.items():
        assert torch.equal(t.float(), rounded[k]), k
    assert torch.equal(_logits(trained["cfg"], sd), _logits(trained["cfg"], rounded))
    # and the rounding is visible: the fp32 model's logits differ
    assert not torch.equal(_logits(trained["cfg"], sd), _logits(trained["cfg"], trained["params"]))


# ------------------------------------------------------------------------------------------ (b) sharded / pt
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_sharded_output_has_a_complete_index(trained, converted, fmt) -> None:
    key, index_name, suffix = (
        ("sharded", "model.safetensors.index.json", ".safetensors")
        if fmt == "safetensors"
        else ("pt-sharded", "pytorch_model.bin.index.json", ".bin")
    )
    _ok(converted["results"][key])
    folder = converted["out"] / key
    index = json.loads((folder / index_name).read_text())
    weight_map = index["weight_map"]
    model = _model(trained["cfg"])
    assert sorted(weight_map) == sorted(model.state_dict())  # every key, once (json keys are unique)
    files = sorted(set(weight_map.values()))
    assert len(files) > 1, "40KB shards of a ~140KB model must split"
    assert sorted(p.name for p in folder.iterdir()) == sorted([*files, index_name])
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        assert name.endswith(suffix)
        part = (
            load_file(str(folder / name))
            if fmt == "safetensors"
            else torch.load(folder / name, weights_only=True)
        )
        assert set(part) == {k for k, f in weight_map.items() if f == name}, name
        data = sum(t.numel() * t.element_size() for t in part.values())
        assert data <= 40_000 or len(part) == 1, (name, data)  # only a lone oversized tensor may exceed it
        merged.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.state_dict().values())
    model.load_state_dict(merged, strict=True)
    assert torch.equal(_logits(trained["cfg"], merged), _logits(trained["cfg"], trained["params"]))


def test_pt_format_loads_with_weights_only(trained, converted) -> None:
    _ok(converted["results"]["pt"])
    sd = torch.load(converted["out"] / "model.pt", weights_only=True)
    assert set(sd) == set(_model(trained["cfg"]).state_dict())
    for name, p in trained["params"].items():
        assert torch.equal(sd[name], p), name
    assert torch.equal(_logits(trained["cfg"], sd), _logits(trained["cfg"], trained["params"]))


# ------------------------------------------------------------------------------------------ (c) memory
# The child: import everything, reset the kernel's peak-RSS mark (/proc/self/clear_refs "5" sets VmHWM to
# the current RSS), run the real CLI entry point, then report VmHWM growth (exact, kernel-tracked) and the
# sampled peak growth of RssAnon (heap only, without the file pages the converter maps).
MEASURE = r"""
import json, sys, threading, time
import safetensors.torch, torch, zoff.cli, zoff.checkpoint.convert  # noqa: F401

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out

report_path = sys.argv[1]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status()
peak = dict(base)
stop = False

def sample():
    while not stop:
        for k, v in status().items():
            peak[k] = max(peak[k], v)
        time.sleep(0.001)

t = threading.Thread(target=sample, daemon=True)
t.start()
sys.argv = ["zoff", "convert", *sys.argv[2:]]
code = 0
try:
    zoff.cli.main()
except SystemExit as e:
    code = e.code or 0
stop = True
t.join()
after = status()
json.dump({"code": code, "base": base, "after": after, "sampled_peak": peak}, open(report_path, "w"))
"""


@pytest.fixture(scope="module")
def big_convert(tmp_path_factory) -> dict:
    """A 20-layer GPT (1 rank, stage 0, 1 step; ~63 MB of fp32 params, 1 MiB largest tensor) converted in a
    fresh subprocess that reports its memory growth."""
    root = tmp_path_factory.mktemp("convert-big")
    cfg = tiny_cfg(
        model={"n_layer": 20, "n_head": 4, "d_model": 256},
        zero={"stage": 0},
        train={"max_steps": 1, "grad_accum": 1, "eval_batches": 1},
        checkpoint={"dir": str(root / "ck")},
    )
    params = run_zoff(cfg, 1, root)[0]["params"]  # the rank runs in its own spawned process
    out, report = root / "model.safetensors", root / "report.json"
    p = subprocess.run(
        [sys.executable, "-c", MEASURE, str(report), str(root / "ck"), str(out)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    _ok(p)
    r = json.loads(report.read_text())
    assert r["code"] == 0, p.stderr
    sizes = [t.numel() * 4 for t in build_model(config_from_dict(cfg).model).state_dict().values()]
    return {"params": params, "out": out, "report": r, "largest": max(sizes), "total": sum(sizes)}


def _memory_bound(largest: int) -> int:
    # The target is ~2x (largest tensor + output shard). A safetensors output is streamed to disk, so
    # no output shard is held; a tensor is assembled once and read from the shard once (2 x largest), and
    # ~24 MiB covers what the run itself allocates besides tensors: the parsed manifest, the shard headers,
    # the progress bar's thread and console, malloc arenas (measured ~8 MiB heap growth in total here).
    return 2 * largest + 24 * MiB


def test_big_checkpoint_shape_makes_the_memory_test_meaningful(big_convert) -> None:
    largest, total = big_convert["largest"], big_convert["total"]
    assert total >= 8 * largest and largest == MiB, (total, largest)
    # A naive converter (load the shards, merge, save) holds at least every merged parameter at once — the
    # whole model, `total` bytes (really more: the shard files are 3x that with the Adam moments). That is
    # over twice the bound, so the bound tests below fail for such an implementation.
    assert total >= 2 * _memory_bound(largest), (total, _memory_bound(largest))
    sd = load_file(str(big_convert["out"]))
    assert set(sd) == set(big_convert["params"])
    for k, p in big_convert["params"].items():
        assert torch.equal(sd[k], p), k


def test_convert_heap_growth_is_bounded(big_convert) -> None:
    """Heap growth (RssAnon, sampled every ms): the converter's own buffers stream tensor by tensor."""
    r = big_convert["report"]
    growth = r["sampled_peak"]["RssAnon"] - r["base"]["RssAnon"]
    bound = _memory_bound(big_convert["largest"])
    assert growth <= bound, f"heap grew {growth / MiB:.1f} MiB, bound {bound / MiB:.1f} MiB"


def test_convert_peak_rss_growth_is_bounded(big_convert) -> None:
    """Peak RSS growth (VmHWM, kernel-tracked after a reset) over the post-import baseline."""
    r = big_convert["report"]
    growth = r["after"]["VmHWM"] - r["base"]["VmRSS"]
    bound = _memory_bound(big_convert["largest"])
    assert growth <= bound, (
        f"peak RSS grew {growth / MiB:.1f} MiB (model {big_convert['total'] / MiB:.1f} MiB), "
        f"bound {bound / MiB:.1f} MiB; file-backed RSS grew "
        f"{(r['sampled_peak']['RssFile'] - r['base']['RssFile']) / MiB:.1f} MiB"
    )


# ------------------------------------------------------------------------------------------ (d) bad input
@pytest.fixture(scope="module")
def bad_inputs(trained, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("convert-bad")
    step = trained["step"]

    def damaged(name: str, how) -> Path:
        ckpt = root / name
        shutil.copytree(step, ckpt)
        how(ckpt)
        return ckpt

    def truncate(ckpt: Path) -> None:
        shard = ckpt / "shard_00001.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])

    def flip(ckpt: Path) -> None:
        shard = ckpt / "shard_00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))

    existing = root / "existing.safetensors"
    existing.write_bytes(b"precious bytes")
    os.utime(existing, (1_000_000_000, 1_000_000_000))
    out = {case: root / f"out-{case}.safetensors" for case in BAD_INPUT_CASES}
    out["existing-out"] = existing
    out["out-dir-missing"] = root / "no-such-dir" / "model.safetensors"
    args = {
        "missing-checkpoint": [root / "no-such-checkpoint", out["missing-checkpoint"]],
        "existing-out": [step, existing],
        "dtype-fp8": [step, out["dtype-fp8"], "--dtype", "fp8"],
        "format-xyz": [step, out["format-xyz"], "--format", "xyz"],
        "shard-size-banana": [step, out["shard-size-banana"], "--max-shard-size", "banana"],
        "truncated-shard": [damaged("truncated", truncate), out["truncated-shard"]],
        "flipped-bytes": [damaged("flipped", flip), out["flipped-bytes"]],
        "missing-manifest": [
            damaged("nomanifest", lambda c: (c / "manifest.json").unlink()),
            out["missing-manifest"],
        ],
        "out-dir-missing": [step, out["out-dir-missing"]],
    }
    return {"root": root, "out": out, "results": _zoff_many(args, fresh="missing-checkpoint")}


EXPECT = {  # case -> substrings of the one error line (the file or option it names, and the problem)
    "missing-checkpoint": ["no-such-checkpoint", "does not exist"],
    "existing-out": ["existing.safetensors", "already exists"],
    "dtype-fp8": ["--dtype", "fp8"],
    "format-xyz": ["--format", "xyz"],
    "shard-size-banana": ["--max-shard-size", "banana"],
    "truncated-shard": ["truncated/shard_00001.safetensors", "truncated"],
    "flipped-bytes": ["flipped/shard_00001.safetensors", "checksum"],
    "missing-manifest": ["nomanifest", "manifest.json"],
    "out-dir-missing": ["no-such-dir"],
}


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zoff: error: "), p.stderr
    return lines[0]


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_bad_input_is_one_line_exit_2(bad_inputs, case) -> None:
    line = _one_error_line(bad_inputs["results"][case])
    for part in EXPECT[case]:
        assert part in line, (part, line)
    if case == "existing-out":
        existing = bad_inputs["out"][case]
        assert existing.read_bytes() == b"precious bytes" and existing.stat().st_mtime == 1_000_000_000
    else:
        assert not bad_inputs["out"][case].exists()
    assert not list(bad_inputs["root"].glob(".*.tmp")), "no temporary output left behind"


@pytest.mark.parametrize("case", ["missing-checkpoint", "missing-manifest"])
def test_checkpoint_errors_do_not_blame_an_option_convert_lacks(bad_inputs, case) -> None:
    line = _one_error_line(bad_inputs["results"][case])
    assert "--resume" not in line and "CHECKPOINT" in line, line
