"""Input fuzzing: bad configs, overrides, CLI flags and corrupted checkpoints end in one line and exit code 2.

Deterministic (random.Random(SEED)). The config loader sees every generated case in-process: each either
loads (some mutations are valid) or raises zoff.errors.UserError with a one-line message, never another
exception. A sample of the failing cases then goes through the real CLI (`validate` and `train`): exit 2,
exactly one stderr line `zoff: error: ...`, no traceback, no run directory. The same for `zoff convert` on
50 corrupted copies of one real checkpoint (most in-process, some through the CLI). Each CLI call is its own
`python -m zoff` process, forked from a server that has imported zoff and torch once (tests.forked_zoff); one of
each kind starts a fresh interpreter.

Every input that once hit a zoff bug (a float overflow, a recipe name too long for the file system, deep
nesting, a multi-line message, manifest fields of the wrong type) now ends in a one-line UserError like the
others: none is tolerated.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import json
import math
import os
import random
import shutil
import string
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from tests.forked_zoff import forked_cli
from zoff.config import Config, list_recipes, load_config
from zoff.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
SEED = 20261122
N_CONFIG_CASES = 560
BASE_TEXT = TINY.read_text()
BASE = yaml.safe_load(BASE_TEXT)


# ------------------------------------------------------------------------------------------ the schema


def _schema(cls=Config, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], typing.Any]:
    """Every key path of the config (sections at every depth, and leaves) -> its type."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, tp = prefix + (f.name,), hints[f.name]
        out[path] = tp
        if dataclasses.is_dataclass(tp):
            out.update(_schema(tp, path))
    return out


SCHEMA = _schema()
SECTIONS = [p for p, tp in SCHEMA.items() if dataclasses.is_dataclass(tp)]
LEAVES = [p for p, tp in SCHEMA.items() if not dataclasses.is_dataclass(tp)]


def _is_number(tp) -> bool:
    args = typing.get_args(tp)
    return tp in (int, float) or any(a in (int, float) for a in args)


NUMERIC = [p for p in LEAVES if _is_number(SCHEMA[p])]


def _set(cfg: dict, path: tuple[str, ...], value) -> None:
    node = cfg
    for k in path[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {} if k != "zero" or not isinstance(node.get(k), str) else {"recipe": node[k]}
        node = node[k]
    node[path[-1]] = value


def _delete(cfg: dict, path: tuple[str, ...]) -> None:
    node = cfg
    for k in path[:-1]:
        node = node.get(k)
        if not isinstance(node, dict):
            return
    node.pop(path[-1], None)


# ------------------------------------------------------------------------------------------ mutations

WRONG_TYPES = ["abc", [1, 2], {"a": 1}, True, False, None, 1.5, "", "1e3x", [], {}, "0x1G", ["a", {"b": 1}]]
BAD_NUMBERS = [-1, -(10**9), 0, 10**30, 2**63, 1e308, -1e-9, 1.5, 7.25, -0.0, 10**6, "1_000", "3e-4", "-3"]
NAN_INF = [math.nan, math.inf, -math.inf, "nan", "inf", "-inf", "NaN", "Infinity", "1e999", ".nan", "-1e999"]
REAL_RECIPES = list_recipes()


def _typo(rng: random.Random, word: str) -> str:
    ops = ["swap", "drop", "double", "upper", "replace", "suffix"]
    for _ in range(10):
        op, w = rng.choice(ops), list(word)
        i = rng.randrange(len(w))
        if op == "swap" and len(w) > 1:
            j = min(i + 1, len(w) - 1)
            w[i], w[j] = w[j], w[i]
        elif op == "drop" and len(w) > 1:
            del w[i]
        elif op == "double":
            w.insert(i, w[i])
        elif op == "upper":
            w[i] = w[i].upper()
        elif op == "replace":
            w[i] = rng.choice(string.ascii_lowercase)
        else:
            w.append(rng.choice("s_2"))
        out = "".join(w)
        if out != word:
            return out
    return word + "x"


def _random_key(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return "".join(rng.choice(string.ascii_lowercase + "_") for _ in range(rng.randint(1, 12)))
    if kind == 1:
        return rng.choice(["lr", "steps", "batch", "gpu", "stage3", "offload", "recipe2", "nodes", "é", "键"])
    if kind == 2:
        return "".join(rng.choice(string.printable.strip()) for _ in range(rng.randint(1, 8)))
    return rng.choice(["x" * 300, "with space", "dots.in.key", "-dash", "123", "true"])


def _text(cfg) -> str:
    return yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)


def _base(rng: random.Random) -> dict:
    cfg = copy.deepcopy(BASE)
    if rng.random() < 0.3:  # also mutate configs whose zero section is a mapping
        cfg["zero"] = {"recipe": rng.choice(REAL_RECIPES)}
    return cfg


def m_wrong_type(rng):
    cfg = _base(rng)
    _set(cfg, rng.choice(LEAVES), rng.choice(WRONG_TYPES))
    return _text(cfg), []


def m_bad_number(rng):
    cfg = _base(rng)
    for _ in range(rng.randint(1, 2)):
        _set(cfg, rng.choice(NUMERIC), rng.choice(BAD_NUMBERS))
    return _text(cfg), []


def m_huge_number(rng):
    cfg = _base(rng)
    digits = rng.choice([20, 40, 310, 400, 1000])
    _set(cfg, rng.choice(NUMERIC), rng.choice([1, -1]) * 10**digits)
    return _text(cfg), []


def m_nan_inf(rng):
    cfg = _base(rng)
    _set(cfg, rng.choice(NUMERIC), rng.choice(NAN_INF))
    return _text(cfg), []


def m_unknown_key(rng):
    cfg = _base(rng)
    where = rng.choice([(), *SECTIONS])
    _set(cfg, (*where, _random_key(rng)), rng.choice([1, "x", None, {"a": 1}]))
    return _text(cfg), []


def m_misspelt_key(rng):
    cfg = _base(rng)
    path = rng.choice(list(SCHEMA))
    _delete(cfg, path)
    _set(cfg, (*path[:-1], _typo(rng, path[-1])), rng.choice([1, "x", {"stage": 2}, True]))
    return _text(cfg), []


def m_missing_sections(rng):
    cfg = _base(rng)
    for k in rng.sample(list(cfg), rng.randint(1, len(cfg))):
        del cfg[k]
    return (_text(cfg) if cfg else ""), []


def m_list_for_mapping(rng):
    cfg = _base(rng)
    path = rng.choice([*SECTIONS, ("model", "args")])
    _set(cfg, path, rng.choice([[1, 2], ["a"], [], [{"stage": 2}], "text", 3, True]))
    return _text(cfg), []


def m_bad_recipe(rng):
    cfg = _base(rng)
    name = rng.choice(
        ["zero4", "zero-2", "Zero2", "zero2_offload", "zer03", "", "zero2.yaml", "../configs/tiny", "z" * 300]
        + [_typo(rng, rng.choice(REAL_RECIPES)) for _ in range(3)]
    )
    shape = rng.randrange(4)
    if shape == 0:
        cfg["zero"] = name
    elif shape == 1:
        cfg["zero"] = {"recipe": name, "stage": rng.randint(0, 3)}
    elif shape == 2:
        cfg["zero"] = {"recipe": rng.choice([5, [1], {"a": 1}, True])}
    else:
        return _text(cfg), [f"zero={name}"]
    return _text(cfg), []


def m_yaml_syntax(rng):
    lines = BASE_TEXT.splitlines()
    i = rng.randrange(len(lines))
    kind = rng.randrange(9)
    if kind == 0:
        lines[i] += " [1, 2"
    elif kind == 1:
        lines[i] += " {a: 1"
    elif kind == 2:
        lines[i] = "\t" + lines[i]
    elif kind == 3:
        lines[i] = lines[i].replace(":", ": :", 1) if ":" in lines[i] else lines[i] + ": : x"
    elif kind == 4:
        lines[i] += ' "unclosed'
    elif kind == 5:
        lines.insert(i, "---")
        lines.insert(0, "a: 1")
    elif kind == 6:
        lines[i] = "   " + lines[i] + "\n  bad: indent"
    elif kind == 7:
        lines[i] = lines[i] + " &anchor *alias"
    else:
        lines[i] = "%TAG ! !bad" if rng.random() < 0.5 else "? [unclosed"
    return "\n".join(lines) + "\n", []


def m_random_bytes(rng):
    n = rng.choice([1, 3, 16, 100, 1000, 5000])
    if rng.random() < 0.5:
        return rng.randbytes(n), []
    alphabet = string.printable + "éü€\u2028\x00\x07"
    return "".join(rng.choice(alphabet) for _ in range(n)), []


def m_empty(rng):
    return rng.choice(
        ["", "\n", "   \n", "# just a comment\n", "---\n", "~\n", "null\n", "...\n", "\ufeff"]
    ), []


def m_top_level(rng):
    return rng.choice(
        ["- a\n- b\n", "42\n", "'text'\n", "[model, data]\n", "true\n", "!!binary aGVsbG8=\n"]
    ), []


def m_deep_nesting(rng):
    depth = rng.choice([10, 50, 200])  # deeper input once raised RecursionError
    return "model:\n  args: " + "[" * depth + "]" * depth + "\n", []


GOOD_OVERRIDES = ["train.max_steps=5", "zero.stage=2", "optim.lr=1e-3", "model.args.x=1", "zero=zero3"]
BAD_OVERRIDES = [
    "train.max_steps=abc", "train.max_stepz=5", "nope=1", "=1", "train", "train.=1", ".train=1",
    "train..x=1", "train.max_steps.x=1", "zero=zeroX", "zero.stage=7", "zero.stage=-1",
    "launch.nnodes=0", "launch.nnodes=2:1", "launch.nnodes=a:b", "launch.nnodes=1:2:3", "launch.nnodes=",
    "optim.betas=[0.9]", "optim.betas=[1.0,0.9]", "optim.betas=0.9", "optim.lr=-1", "optim.lr=nan",
    "optim.lr=inf", "optim.lr=.inf", "data.paths={a: 1}", "model.args=[1]", "train.precision=fp8",
    "log.progress=maybe", "launch.nproc_per_node=2000", "train.global_batch_size=7", "model.d_model=33",
    "data.seq_len=10000", "train.max_steps=1.5", "train.max_steps=[1]", "train.max_steps={a: 1}",
    "data.name=texts", "data.name=text", "optim.name=sgd", "launch.timeout_s=0", "schedule.decay=cos",
    "train.seed=-5", "model.vocab_size=1", "zero.offload_optimizer=cpu", "zero.offload_optimizer.device=gpu",
    "train=5", "model=gpt", "launch.max_restarts=-1", "checkpoint.keep_last=0", "train.max_steps=",
]  # fmt: skip


def m_overrides(rng):
    items = [rng.choice(BAD_OVERRIDES) for _ in range(rng.randint(1, 3))]
    items += rng.sample(GOOD_OVERRIDES, rng.randint(0, 2))
    rng.shuffle(items)
    if rng.random() < 0.3:  # a random path and a random value
        path = rng.choice(list(SCHEMA))
        value = rng.choice(
            [*map(str, BAD_NUMBERS), *map(str, NAN_INF), "[1, 2]", "{a: 1}", "null", "yes", "abc"]
        )
        items.append(".".join(path) + "=" + value)
    return BASE_TEXT, items


MUTATIONS = [
    m_wrong_type, m_bad_number, m_huge_number, m_nan_inf, m_unknown_key, m_misspelt_key, m_missing_sections,
    m_list_for_mapping, m_bad_recipe, m_yaml_syntax, m_random_bytes, m_empty, m_top_level, m_deep_nesting,
    m_overrides, m_overrides,
]  # fmt: skip


def generate(n: int = N_CONFIG_CASES, seed: int = SEED) -> list[tuple[str, str | bytes, list[str]]]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        mutate = MUTATIONS[i % len(MUTATIONS)]
        text, overrides = mutate(rng)
        cases.append((f"{i:03d}-{mutate.__name__[2:]}", text, overrides))
    return cases


def _outcome(path: Path, overrides: list[str]) -> tuple[str, BaseException | None]:
    try:
        load_config(path, overrides)
        return "ok", None
    except UserError as e:
        msg = str(e)
        if msg.strip() and "\n" not in msg and "\r" not in msg:
            return "user-error", e
        return "multi-line-message", e
    except Exception as e:  # noqa: BLE001 - the point: any other exception type is a finding
        return "crash", e


def _write(tmp: Path, name: str, text: str | bytes) -> Path:
    path = tmp / f"{name}.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def config_outcomes(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("fuzz-configs")
    out = []
    for name, text, overrides in generate():
        path = _write(tmp, name, text)
        kind, exc = _outcome(path, overrides)
        out.append({"name": name, "path": path, "overrides": overrides, "kind": kind, "exc": exc})
    return out


# ------------------------------------------------------------------------------------------ config tests


def test_the_generator_is_deterministic_and_covers_every_mutation():
    a, b = generate(), generate()
    assert a == b and len(a) >= 500
    kinds = {name.split("-", 1)[1] for name, _, _ in a}
    assert kinds == {m.__name__[2:] for m in MUTATIONS}


def test_every_fuzzed_config_loads_or_fails_with_one_line_user_error(config_outcomes):
    unexplained = [o for o in config_outcomes if o["kind"] not in ("ok", "user-error")]
    lines = [
        f"{o['name']} {o['overrides']}: {type(o['exc']).__name__}: {str(o['exc'])[:200]!r}"
        for o in unexplained
    ]
    assert not unexplained, (
        f"{len(unexplained)} case(s) end neither in a config nor in a one-line UserError:\n"
        + ("\n".join(lines))
    )
    counts = {k: sum(o["kind"] == k for o in config_outcomes) for k in ("ok", "user-error")}
    assert counts["user-error"] >= 300 and counts["ok"] >= 20, counts  # the mutations mostly break configs
    print(f"{len(config_outcomes)} fuzzed configs: {counts}")


def test_every_failing_config_message_names_a_key_or_the_file(config_outcomes):
    """A one-line error is only useful if it says where: the file, a dotted key, or the override."""
    for o in config_outcomes:
        if o["kind"] != "user-error":
            continue
        msg = str(o["exc"])
        where = [
            str(o["path"]),
            "override '",
            "recipe",
            *(".".join(p) for p in SCHEMA),
            *(p[-1] for p in SCHEMA),
        ]
        assert any(w in msg for w in where) or msg.startswith(("unknown key", "config:")), (o["name"], msg)


# Minimal reproductions of the zoff bugs the fuzzing found (config.py, schema.py); strict: they fail until fixed.


@pytest.mark.parametrize("how", ["yaml", "override"])
def test_an_integer_too_large_for_a_float_key_is_a_user_error(tmp_path, how):
    big = "1" + "0" * 400
    if how == "yaml":
        path = _write(tmp_path, "big", BASE_TEXT.replace("lr: 3.0e-3", f"lr: {big}"))
        overrides = []
    else:
        path, overrides = TINY, [f"optim.lr={big}"]
    with pytest.raises(UserError, match="optim.lr"):
        load_config(path, overrides)


def test_an_overlong_recipe_name_is_a_user_error():
    with pytest.raises(UserError, match="unknown recipe"):
        load_config(TINY, ["zero=" + "z" * 300])


@pytest.mark.parametrize("text", ["[" * 3000 + "]" * 3000, "model:\n  args: &x {a: *x}\n"])
def test_pathologically_nested_yaml_is_a_user_error(tmp_path, text):
    with pytest.raises(UserError):
        load_config(_write(tmp_path, "deep", text))


@pytest.mark.parametrize("how", ["yaml", "override"])
def test_an_error_about_a_key_with_a_newline_is_one_line(tmp_path, how):
    if how == "yaml":
        path, overrides = _write(tmp_path, "nl", BASE_TEXT + '"bad\\nkey": 1\n'), []
    else:
        path, overrides = TINY, ["bad\nkey=1"]
    with pytest.raises(UserError) as e:
        load_config(path, overrides)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------- the CLI


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZOFF_TEST_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _zoff_many(
    calls: list[list[str]], fresh: set[int] | frozenset[int] = frozenset(), timeout: float = 120
) -> list[subprocess.CompletedProcess]:
    """`python -m zoff ARGS` for every call at once, their results in order: the calls whose index is in
    `fresh` in new interpreters, the others forked from the tests' fork server."""
    env = _env()
    started = {
        i: subprocess.Popen(
            [sys.executable, "-m", "zoff", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, args in enumerate(calls)
        if i in fresh
    }
    try:
        forked = [(args, REPO, env) for i, args in enumerate(calls) if i not in fresh]
        served = iter(forked_cli(forked, timeout) if forked else [])
        done = []
        for i in range(len(calls)):
            if i in started:
                out, err = started[i].communicate(timeout=timeout)  # a hung CLI fails the test, not the suite
                done.append(subprocess.CompletedProcess(started[i].args, started[i].returncode, out, err))
            else:
                done.append(next(served))
        return done
    finally:
        for p in started.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _zoff(*args: str, timeout: float = 120, fresh: bool = False) -> subprocess.CompletedProcess:
    return _zoff_many([list(args)], {0} if fresh else frozenset(), timeout)[0]


def _one_line_exit_2(p: subprocess.CompletedProcess, what: str) -> str:
    lines = p.stderr.splitlines()
    assert p.returncode == 2, f"{what}: exit {p.returncode}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, f"{what}:\n{p.stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("zoff: error: "), f"{what}: {lines}"
    return lines[0]


@pytest.mark.slow
def test_the_cli_rejects_a_sample_of_failing_configs_in_one_line_without_starting(config_outcomes, tmp_path):
    failing = [o for o in config_outcomes if o["kind"] == "user-error"]
    sample = random.Random(SEED + 1).sample(failing, 20)
    calls = []
    for o in sample:
        calls.append(["validate", str(o["path"]), *o["overrides"]])
        calls.append(
            ["train", str(o["path"]), *o["overrides"], "--run-dir", str(tmp_path / f"run-{o['name']}")]
        )
    results = _zoff_many(calls, fresh={0, 1})  # the first case's validate and train in new interpreters
    for i, o in enumerate(sample):
        v, t, run_dir = results[2 * i], results[2 * i + 1], tmp_path / f"run-{o['name']}"
        line_v = _one_line_exit_2(v, f"validate {o['name']}")
        line_t = _one_line_exit_2(t, f"train {o['name']}")
        assert line_v == line_t == f"zoff: error: {o['exc']}", (line_v, line_t)
        assert not run_dir.exists(), f"{o['name']}: a run directory was created"
        assert "zoff: run directory" not in t.stdout


FLAG_CASES = [
    ["--nproc-per-node", "abc"], ["--nproc-per-node", "0"], ["--nproc-per-node", "-3"], ["--nnodes", "0"],
    ["--nnodes", "3:1"], ["--nnodes", "x"], ["--max-restarts", "-1"], ["--max-restarts", "1.5"],
    ["--node-rank", "-1"], ["--resume", "/nonexistent/checkpoint"], ["--bogus-flag"], ["--run-dir"],
]  # fmt: skip


@pytest.mark.slow
def test_bad_train_flags_are_one_line_errors_without_starting(tmp_path):
    run_dirs = [tmp_path / f"run{i}" for i in range(len(FLAG_CASES))]
    calls = [
        ["train", str(TINY), *flags, *([] if flags == ["--run-dir"] else ["--run-dir", str(run_dir)])]
        for flags, run_dir in zip(FLAG_CASES, run_dirs)
    ]
    # --resume gets furthest (torch, the preflight model build): in a new interpreter
    results = _zoff_many(calls, fresh={FLAG_CASES.index(["--resume", "/nonexistent/checkpoint"])})
    for flags, p, run_dir in zip(FLAG_CASES, results, run_dirs):
        _one_line_exit_2(p, " ".join(flags))
        assert not run_dir.exists(), flags


@pytest.mark.slow
def test_a_bad_rdzv_endpoint_is_a_one_line_error(tmp_path):
    run_dir = tmp_path / "run"
    p = _zoff(
        "train",
        str(TINY),
        "train.max_steps=1",
        "--rdzv-endpoint",
        "127.0.0.1:notaport",
        "--run-dir",
        str(run_dir),
    )
    _one_line_exit_2(p, "--rdzv-endpoint 127.0.0.1:notaport")
    assert not run_dir.exists()


# ------------------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory) -> Path:
    """One real 2-rank ZeRO-2 checkpoint (2 shard files) made by the CLI."""
    run_dir = tmp_path_factory.mktemp("fuzz-ckpt") / "run"
    args = ["train", str(TINY), "train.max_steps=2", "zero=zero2", "--run-dir", str(run_dir)]
    p = _zoff(*args, timeout=300, fresh=True)  # a real run: a new interpreter
    assert p.returncode == 0, p.stderr[-3000:]
    (ckpt,) = sorted((run_dir / "checkpoints").glob("step_*"))
    assert (ckpt / "shard_00001.safetensors").is_file()
    return ckpt


def _manifest(edit):
    def corrupt(d: Path, rng: random.Random) -> None:
        m = json.loads((d / "manifest.json").read_text())
        edit(m, rng)
        (d / "manifest.json").write_text(json.dumps(m))

    return corrupt


def _resign(d: Path, name: str) -> None:
    """Make the manifest's size and checksum of `name` match the file again (a consistent but bad file)."""
    m = json.loads((d / "manifest.json").read_text())
    data = (d / name).read_bytes()
    m["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "manifest.json").write_text(json.dumps(m))


def _truncate(name: str, keep: float):
    def corrupt(d, rng):
        p = d / name
        p.write_bytes(p.read_bytes()[: int(p.stat().st_size * keep)])

    return corrupt


def _flip(name: str, where: str):
    def corrupt(d, rng):
        p = d / name
        data = bytearray(p.read_bytes())
        header = 8 + int.from_bytes(data[:8], "little")
        lo, hi = {"length": (0, 8), "header": (8, header), "data": (header, len(data))}[where]
        data[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(data))

    return corrupt


def _delete_file(name: str):
    return lambda d, rng: (d / name).unlink()


def _random_file(name: str, resign: bool):
    def corrupt(d, rng):
        p = d / name
        p.write_bytes(rng.randbytes(p.stat().st_size))
        if resign:
            _resign(d, name)

    return corrupt


def _manifest_text(text: str | bytes):
    def corrupt(d, rng):
        p = d / "manifest.json"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())

    return corrupt


def _first_piece(m):
    return m["params"][0]["pieces"][0]


S0, S1, EXTRA, RNG0 = (
    "shard_00000.safetensors",
    "shard_00001.safetensors",
    "extra.safetensors",
    "rng_00000.safetensors",
)


CORRUPTIONS = [
    ("truncate-shard0-half", _truncate(S0, 0.5)),
    ("truncate-shard1-empty", _truncate(S1, 0.0)),
    ("truncate-shard0-7-bytes", lambda d, rng: (d / S0).write_bytes((d / S0).read_bytes()[:7])),
    ("truncate-extra", _truncate(EXTRA, 0.9)),
    ("truncate-rng0", _truncate(RNG0, 0.5)),
    ("append-to-shard1", lambda d, rng: (d / S1).write_bytes((d / S1).read_bytes() + b"\0" * 8)),
    ("flip-shard0-length", _flip(S0, "length")),
    ("flip-shard0-header", _flip(S0, "header")),
    ("flip-shard0-data", _flip(S0, "data")),
    ("flip-shard1-data", _flip(S1, "data")),
    ("flip-extra-header", _flip(EXTRA, "header")),
    ("flip-rng0-data", _flip(RNG0, "data")),
    ("delete-shard0", _delete_file(S0)),
    ("delete-shard1", _delete_file(S1)),
    ("delete-extra", _delete_file(EXTRA)),
    ("delete-rng0", _delete_file(RNG0)),
    ("delete-manifest", _delete_file("manifest.json")),
    ("random-shard0", _random_file(S0, resign=False)),
    ("random-shard1-resigned", _random_file(S1, resign=True)),
    ("random-extra-resigned", _random_file(EXTRA, resign=True)),
    ("shard0-replaced-by-a-directory", lambda d, rng: ((d / S0).unlink(), (d / S0).mkdir())),
    ("manifest-garbage-json", _manifest_text('{"format_version": 1, "files": {')),
    ("manifest-empty", _manifest_text("")),
    ("manifest-random-bytes", lambda d, rng: (d / "manifest.json").write_bytes(rng.randbytes(300))),
    ("manifest-not-utf8", _manifest_text(b'{"format_version": 1, "files": {"\xff": 1}}')),
    ("manifest-null", _manifest_text("null")),
    ("manifest-list", _manifest_text("[1, 2]")),
    ("manifest-number", _manifest_text("42")),
    ("manifest-no-files", _manifest(lambda m, rng: m.pop("files"))),
    ("manifest-no-format-version", _manifest(lambda m, rng: m.pop("format_version"))),
    ("manifest-future-version", _manifest(lambda m, rng: m.__setitem__("format_version", 99))),
    ("manifest-file-bytes-wrong", _manifest(lambda m, rng: m["files"][S0].__setitem__("bytes", 12))),
    ("manifest-file-bytes-string", _manifest(lambda m, rng: m["files"][S0].__setitem__("bytes", "12"))),
    ("manifest-file-sha-wrong", _manifest(lambda m, rng: m["files"][S1].__setitem__("sha256", "0" * 64))),
    ("manifest-lists-a-missing-file", _manifest(lambda m, rng: m["files"].__setitem__("shard_00009.safetensors", m["files"][S0]))),
    ("manifest-piece-in-unlisted-file", _manifest(lambda m, rng: _first_piece(m).__setitem__("file", "shard_00009.safetensors"))),
    ("manifest-piece-too-long", _manifest(lambda m, rng: _first_piece(m).__setitem__("length", 10**9))),
    ("manifest-piece-bad-unit", _manifest(lambda m, rng: _first_piece(m).__setitem__("unit", 7))),
    # wrong types and missing keys (once zoff bugs: a TypeError or KeyError, not a UserError)
    ("manifest-files-a-list", _manifest(lambda m, rng: m.__setitem__("files", []))),
    ("manifest-files-null", _manifest(lambda m, rng: m.__setitem__("files", None))),
    ("manifest-file-meta-a-string", _manifest(lambda m, rng: m["files"].__setitem__(S0, "x"))),
    ("manifest-file-meta-no-sha", _manifest(lambda m, rng: m["files"][S0].pop("sha256"))),
    ("manifest-version-a-string", _manifest(lambda m, rng: m.__setitem__("format_version", "1"))),
    ("manifest-version-null", _manifest(lambda m, rng: m.__setitem__("format_version", None))),
    ("manifest-no-params", _manifest(lambda m, rng: m.pop("params"))),
    ("manifest-params-a-mapping", _manifest(lambda m, rng: m.__setitem__("params", {"a": 1}))),
    ("manifest-param-no-pieces", _manifest(lambda m, rng: m["params"][0].pop("pieces"))),
    ("manifest-param-shape-a-string", _manifest(lambda m, rng: m["params"][0].__setitem__("shape", "abc"))),
    ("manifest-state-dict-keys-a-number", _manifest(lambda m, rng: m.__setitem__("state_dict_keys", 5))),
    ("checkpoint-dir-empty", lambda d, rng: [p.unlink() for p in d.iterdir()]),
]  # fmt: skip
CLI_CORRUPTIONS = [
    "truncate-shard0-half", "flip-shard1-data", "delete-extra", "delete-manifest", "random-shard1-resigned",
    "manifest-garbage-json", "manifest-list", "manifest-future-version", "manifest-piece-too-long",
    "checkpoint-dir-empty", "manifest-files-a-list", "manifest-piece-in-unlisted-file",
]  # fmt: skip


def _params(names: list[str] | None = None) -> list:
    return [pytest.param(c[0], id=c[0]) for c in CORRUPTIONS if names is None or c[0] in names]


def _corrupted_copy(real_checkpoint: Path, tmp_path: Path, name: str) -> Path:
    corrupt = next(c[1] for c in CORRUPTIONS if c[0] == name)
    d = tmp_path / "ckpt" / real_checkpoint.name
    shutil.copytree(real_checkpoint, d)
    corrupt(d, random.Random(f"{SEED}-{name}"))
    return d


def test_there_are_50_checkpoint_corruptions():
    names = [c[0] for c in CORRUPTIONS]
    assert len(names) == len(set(names)) == 50
    assert set(CLI_CORRUPTIONS) <= set(names) and len(CLI_CORRUPTIONS) >= 10


@pytest.mark.slow
@pytest.mark.parametrize("name", _params())
def test_convert_of_a_corrupted_checkpoint_is_a_user_error_naming_a_file(real_checkpoint, tmp_path, name):
    from zoff.checkpoint.convert import convert

    d = _corrupted_copy(real_checkpoint, tmp_path, name)
    out = tmp_path / "out.safetensors"
    gc.freeze()  # what exists already stays out of the collection below (the whole heap: ~0.4 s a case)
    try:
        with pytest.raises(UserError) as e:
            convert(d, out)
    finally:
        # Run the finalizers of the readers convert opened now: a finalizer that raises during a later
        # ast.parse (pytest rendering a traceback) trips CPython 3.11.7's AST recursion-depth check.
        gc.collect()
        gc.unfreeze()
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg, msg  # names the checkpoint folder or a file in it
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(CLI_CORRUPTIONS))
def test_zoff_convert_cli_on_a_corrupted_checkpoint_exits_2_with_one_line(real_checkpoint, tmp_path, name):
    d = _corrupted_copy(real_checkpoint, tmp_path, name)
    out = tmp_path / "out.safetensors"
    line = _one_line_exit_2(_zoff("convert", str(d), str(out), fresh=name == CLI_CORRUPTIONS[0]), name)
    assert str(d) in line, line
    assert not out.exists()


@pytest.mark.slow
def test_zoff_convert_of_the_intact_checkpoint_works(real_checkpoint, tmp_path):
    """The corruptions are what fails: the same copy, untouched, converts."""
    d = tmp_path / "ckpt" / real_checkpoint.name
    shutil.copytree(real_checkpoint, d)
    p = _zoff("convert", str(d), str(tmp_path / "out.safetensors"), fresh=True)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
