"""The typed contract between the sweep runner and one trial: written as spec.json, read back typed.

`Hparams` has one field per factor of the registry (llmlab.sweep.factors), so a new factor reaches the trial without
touching this file. `TrialSpec` holds everything else a trial needs, with its defaults here and nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Optional

from llmlab.sweep.factors import REGISTRY

SPLITS = ("train", "validation")  # the token arrays (data/<split>.npy) every trial memory-maps

Hparams = make_dataclass(
    "Hparams",
    [(name, Any) for name in REGISTRY],
    frozen=True,
    namespace={"__doc__": "One trial's level of every factor (llmlab.sweep.factors.REGISTRY)."},
)


@dataclass(frozen=True)
class TrialSpec:
    trial_id: str
    trial_dir: str
    data_dir: str
    hparams: Any  # Hparams
    seed: int
    steps: int
    replicate: int = 0
    model: str = "minimal"
    model_width: Optional[int] = None
    model_depth: Optional[int] = None
    embedding: str = "trainable"
    parametrization: str = "standard"
    mup_base_width: int = 192
    head_dim: int = 32  # the minimal model's attention head width
    gradient_checkpointing: bool = False
    block_size: int = 128
    micro_batch_size: Optional[int] = None  # the largest batch per forward pass (None: the trial's batch)
    warmup_scale: float = 1.0  # warmup levels are steps of the full protocol; smaller budgets scale them
    eval_batch_size: int = 4
    eval_batches: int = 8
    log_every: int = 10
    fail_loss: Optional[float] = None
    fail_margin: float = 1.0
    fail_grad_norm: float = 1000.0
    flat_tolerance: float = 1e-5
    flat_window: int = 100
    precheck_steps: int = 10
    retry: bool = True
    timeout_s: int = 1200
    device: str = "cpu"
    precision: str = "fp32"
    compile: bool = False
    threads: int = 0  # set by the launcher: CPU threads of this trial
    report_to: list = field(default_factory=lambda: ["tensorboard"])  # the trackers, as the trainers' --report_to
    driver: Optional[list] = field(default=None)  # [pid, start time] of the sweep driver the trial dies with
    # a held-out trial of a scan: the commit and sha256 of the pre-registration it was blind to (result.json keeps it)
    registration: Optional[dict] = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "TrialSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown spec keys {unknown}: this spec was written by another llmlab version")
        return cls(**{**data, "hparams": Hparams(**data["hparams"])})

    @classmethod
    def read(cls, path: str | Path) -> "TrialSpec":
        return cls.from_json(json.loads(Path(path).read_text()))


SLOW_PRECHECK = "exceeds the trial timeout"  # the pre-check's words for a projected overrun


def load_results(out_dir: Path, design: list[dict], rerun: bool = True) -> list[dict]:
    """Finished trials' results; a damaged result.json (a disk that filled, a killed copy, valid JSON of the wrong
    shape) is left out, and the trial runs again unless this is a report-only pass."""
    rows = []
    for trial in design:
        path = out_dir / "trials" / trial["trial_id"] / "result.json"
        if path.is_file():
            try:
                result = json.loads(path.read_text())
                if (
                    not isinstance(result, dict)
                    or result.get("trial_id") != trial["trial_id"]
                    or "status" not in result
                ):
                    raise ValueError("not a trial result")
                if result["status"] == "failed" and SLOW_PRECHECK in (result.get("failures") or ["-"])[-1]:
                    result["status"] = "timeout"  # written before a last attempt's projected overrun was a timeout
                rows.append(result)
            except (ValueError, UnicodeDecodeError):
                then = "the next run of this command runs it again" if not rerun else "it will run again"
                print(f"note: {path} is damaged; trial {trial['trial_id']} is left out ({then})", flush=True)
    return rows
