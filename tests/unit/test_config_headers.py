"""Shipped configs' headers quote `zoff estimate`: the per-GPU (and per-node CPU) figure a header states for
the config's own policy must be what `zoff estimate CONFIG` prints, to the printed digit.

Re-derive stale headers with `python scripts/config_headers.py`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from zoff.planning import estimate as E
from zoff.units import human

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("config_headers", REPO / "scripts" / "config_headers.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

CLAIMING = [p for p in sorted((REPO / "configs").glob("*.yaml")) if H.stated(p) is not None]


def test_the_big_configs_state_a_figure() -> None:
    """A rewording that the parser misses would silently skip a header: these two must be found."""
    assert {"gpt-7b.yaml", "gpt-70b.yaml"} <= {p.name for p in CLAIMING}
    assert H.stated(REPO / "configs" / "gpt-7b.yaml")["cpu"] is not None


def test_header_parsing() -> None:
    assert H.same_figure("100 GiB", "100.0 GiB") and not H.same_figure("100 GiB", "100.7 GiB")
    assert not H.same_figure("1.1 TiB", "1.1 GiB")


@pytest.mark.parametrize("path", CLAIMING, ids=[p.name for p in CLAIMING])
def test_header_matches_zoff_estimate(path: Path, capsys) -> None:
    # What `zoff estimate CONFIG --json` prints on a CUDA box (sizes given: no detection); the table prints
    # human() of the same bytes. The budget decides only the fits column, not the figures.
    E.run_cli(path, [], None, None, "80GiB", "4TiB", as_json=True, suggest=False)
    (row,) = [p for p in json.loads(capsys.readouterr().out)["policies"] if p["configured"]]
    printed = {"gpu": human(row["gpu_bytes"]), "cpu": human(row["cpu_bytes_per_node"])}
    derived = H.derived(path)
    assert printed == {k: derived[k] for k in printed}, "scripts/config_headers.py disagrees with the CLI"

    claim = H.stated(path)
    where = (
        f"{path.name}: {derived['policy']} on {derived['gpus_per_node']} GPU(s): the header states "
        f"{claim['gpu']} per GPU and {claim['cpu'] or '-'} CPU per node, zoff estimate prints "
        f"{printed['gpu']} and {printed['cpu']} (re-derive: python scripts/config_headers.py)"
    )
    assert H.same_figure(claim["gpu"], printed["gpu"]), where
    if claim["cpu"] is not None:
        assert H.same_figure(claim["cpu"], printed["cpu"]), where
