"""Experiment trackers beside metrics.jsonl (rank 0): Weights & Biases (log.wandb) and MLflow (log.mlflow).

Each gets the run's name, its resolved config, every number metrics.jsonl records at the same step (training
steps and evaluations), the plan's memory figures and the summary. The tracker's run id is kept in the run
directory (trackers.json), so a restart or `--resume auto` in the same run directory continues the same
tracker run instead of starting another. Where they send things is theirs to configure: WANDB_MODE (offline),
WANDB_API_KEY or `wandb login`; MLFLOW_TRACKING_URI (a server, or a file store)."""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path

from zoff.config import LogConfig
from zoff.errors import UserError

IDS = "trackers.json"


def check_installed(cfg: LogConfig) -> None:
    """Pre-flight: each asked-for tracker's package imports (one line naming the extra otherwise)."""
    for on, module, extra in ((cfg.wandb, "wandb", "wandb"), (cfg.mlflow, "mlflow", "mlflow")):
        if on:
            try:
                __import__(module)
            except ImportError:
                raise UserError(
                    f"log.{module}: needs the {module} package (pip install zoff[{extra}])"
                ) from None


class Trackers:
    """The trackers log.wandb and log.mlflow ask for; a no-op when neither is on."""

    def __init__(self, cfg: LogConfig, run_dir: Path, config: dict, plan: dict):
        self.run_dir, self.wandb, self.mlflow = run_dir, None, None
        ids = self._ids()
        name = cfg.run_name or run_dir.name
        if cfg.wandb:
            import wandb

            self.wandb = wandb.init(
                project=cfg.project, name=name, id=ids.get("wandb") or uuid.uuid4().hex[:12],
                resume="allow", config=config, dir=str(run_dir), reinit="finish_previous",
            )  # fmt: skip
            self.wandb.summary.update({f"plan/{k}": v for k, v in plan.items()})
            ids["wandb"] = self.wandb.id
        if cfg.mlflow:
            import mlflow

            mlflow.set_experiment(cfg.project)
            self.mlflow = mlflow.start_run(
                run_id=ids.get("mlflow"), run_name=None if ids.get("mlflow") else name
            )
            if "mlflow" not in ids:  # a resumed run keeps what its start logged
                mlflow.log_dict(config, "config.json")
                mlflow.log_params(_flat(config))
                mlflow.log_metrics({f"plan/{k}": float(v) for k, v in plan.items()}, step=0)
            ids["mlflow"] = self.mlflow.info.run_id
        if ids:
            (run_dir / IDS).write_text(json.dumps(ids, indent=1) + "\n")

    def log(self, record: dict) -> None:
        """A metrics.jsonl record's numbers, at its step. Best effort: a tracker that fails mid-run (its server
        gone) is dropped with one warning; the run, and metrics.jsonl, go on."""
        numbers = {k: float(v) for k, v in record.items() if k != "step" and _number(v)}
        if not numbers:
            return
        step = int(record["step"])
        if self.wandb is not None:
            self._guard("wandb", lambda: self.wandb.log(numbers, step=step))
        if self.mlflow is not None:
            import mlflow

            self._guard("mlflow", lambda: mlflow.log_metrics(numbers, step=step))

    def close(self, summary: dict | None = None) -> None:
        """Finish both runs: with the summary after a run that ended, marked failed without one."""
        numbers = {k: float(v) for k, v in (summary or {}).items() if _number(v)}
        if self.wandb is not None:
            run, self.wandb = self.wandb, None
            if summary is not None:
                run.summary.update(numbers)
            run.finish(exit_code=0 if summary is not None else 1)
        if self.mlflow is not None:
            import mlflow

            self.mlflow = None
            if summary is not None:
                mlflow.log_dict(summary, "summary.json")
            mlflow.end_run("FINISHED" if summary is not None else "FAILED")

    def _guard(self, name: str, call) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the trackers' clients raise their own kinds (HTTP, auth, I/O)
            warnings.warn(f"log.{name}: logging failed ({type(e).__name__}: {str(e)[:200]}); metrics.jsonl goes "
                          f"on without {name}", stacklevel=2)  # fmt: skip
            setattr(self, name, None)

    def _ids(self) -> dict:
        try:
            ids = json.loads((self.run_dir / IDS).read_text())
        except (OSError, ValueError):
            return {}
        return (
            {k: v for k, v in ids.items() if k in ("wandb", "mlflow") and isinstance(v, str)}
            if isinstance(ids, dict)
            else {}
        )


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params (dotted keys; values cut to MLflow's 6000 characters)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:6000]
    return out
