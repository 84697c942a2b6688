"""Training checkpoints: accelerate's save_state, sealed by a manifest with a sha256 of every file.

A checkpoint is output_dir/checkpoints/step_N. It is written under a temporary name and renamed into place only
when complete; trainer_state.json, written last, holds the format, the resolved config, the run's layout and
a size + sha256 of every file. Loading verifies all of it before anything is loaded, so a truncated, emptied or
overwritten file is refused by name; with `latest` the newest *good* checkpoint is used and the damaged one is
named. Weights that are not finite are never sealed as a checkpoint.

What must match on resume is checked against the saved config: options a trainer lists as resumable (the
schedule's length and lr, cadences, logging) are honoured; any other change is refused, naming the option.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from llmlab.core.config import to_dict
from llmlab.core.errors import UserError, write_failure
from llmlab.core.identity import file_sha256
from llmlab.core.io import atomic_write_json, publish_dir
from llmlab.train.config import CheckpointGroup

STATE_FILE = "trainer_state.json"
FORMAT = "llmlab-checkpoint/2"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoints_dir(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Published checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def remove_partial_saves(output_dir: str | os.PathLike) -> None:
    root = checkpoints_dir(output_dir)
    if root.is_dir():
        for leftover in root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _manifest(folder: Path) -> dict[str, dict]:
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def read_trainer_state(path: str | os.PathLike) -> dict:
    """The manifest of a checkpoint, after verifying that every file it lists is there, whole and unchanged."""
    path = Path(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        raise UserError(
            f"checkpoint {path} is incomplete or not a checkpoint ({STATE_FILE} missing); "
            "pass a checkpoints/step_N folder written by train_pretrain.py or train_lora.py"
        ) from None
    except (OSError, ValueError) as err:
        raise UserError(
            f"checkpoint {path} is unreadable ({STATE_FILE}: {err}); resume from an older checkpoint folder"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} has an unknown format; it was not written by this version of llmlab")
    missing = [key for key in ("step", "config", "layout", "trainer", "files") if key not in state]
    if missing or not isinstance(state["files"], dict):
        raise UserError(
            f"checkpoint {path} is unreadable ({STATE_FILE} lacks {(missing or ['files'])[0]!r}); "
            "resume from an older checkpoint folder"
        )
    for rel, expected in state.get("files", {}).items():
        file = path / rel
        if not file.is_file() or file.stat().st_size != expected["size"]:
            raise UserError(
                f"checkpoint {path} is damaged ({rel} missing or truncated); resume from an older checkpoint folder"
            )
        if file_sha256(file) != expected["sha256"]:
            raise UserError(
                f"checkpoint {path} is damaged and unreadable ({rel} does not match its sha256); "
                "resume from an older checkpoint folder"
            )
    return state


def newest_good_checkpoint(output_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and why newer ones did not."""
    problems = []
    for path in reversed(list_checkpoints(output_dir)):
        try:
            read_trainer_state(path)
            return path, problems
        except UserError as err:
            problems.append(str(err).split(";")[0])
    return None, problems


def checkpoint_step(path: Path) -> int:
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else -1


def resolve_checkpoint(output_dir: str | os.PathLike, value: str, log: Callable[[str], None] = print) -> Path:
    """`--resume_from_checkpoint latest|PATH` -> a verified checkpoint folder, or a UserError saying what to do."""
    if value == "latest":
        if not list_checkpoints(output_dir):
            raise UserError(
                f"--resume_from_checkpoint latest: no checkpoint in {checkpoints_dir(output_dir)}; "
                "start without --resume_from_checkpoint, or pass a checkpoint folder"
            )
        path, problems = newest_good_checkpoint(output_dir)
        if path is None:
            raise UserError(
                f"--resume_from_checkpoint latest: every checkpoint in {checkpoints_dir(output_dir)} is "
                f"damaged ({problems[0]}); start a new run with --overwrite_output_dir"
            )
        for problem in problems:
            log(f"note: {problem}; resuming from {path.name}, the newest good checkpoint")
        return path
    path = Path(value)
    if not path.is_dir():
        raise UserError(
            f"--resume_from_checkpoint: {path} is not a folder; pass 'latest' or a checkpoints/step_N folder"
        )
    try:
        read_trainer_state(path)
    except UserError as err:
        good, _ = newest_good_checkpoint(path.parent.parent) if path.parent.name == "checkpoints" else (None, [])
        hint = f"; the newest good one is {good}" if good is not None and good != path else ""
        raise UserError(f"{err}{hint}") from None
    return path


def assert_finite(model, what: str) -> None:
    """Refuse to seal weights that hold NaN or inf: a checkpoint or final model must be usable."""
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param.detach()).all()):
            raise UserError(
                f"{what}: weight {name} is not finite (NaN/inf); nothing was saved. The run diverged: "
                "lower --learning_rate or --clip and resume from the last good checkpoint"
            )


def save_checkpoint(
    accelerator,
    output_dir: str | os.PathLike,
    step: int,
    manifest: dict,
    keep_last: int,
    model=None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Save everything needed to continue exactly; every process must call this.

    `write_extra(folder)` adds the trainer's own files (main process only) before the checkpoint is sealed."""
    if model is not None:
        assert_finite(accelerator.unwrap_model(model), f"checkpoint at step {step}")
    root = checkpoints_dir(output_dir)
    final, tmp = root / f"step_{step}", root / f".tmp-step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))  # model, optimizer, scaler, RNG states, every registered object
    except Exception as err:  # torch's RuntimeError, safetensors' own error, OSError: whatever the disk did
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(err, f"checkpoint {final}") from None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        try:
            if write_extra is not None:
                write_extra(tmp)
            atomic_write_json(tmp / STATE_FILE, {"format": FORMAT, **manifest, "files": _manifest(tmp)})
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_error(err, f"checkpoint {final}") from None
        publish_dir(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def write_error(err: Exception, what: str) -> UserError:
    """A failed checkpoint or run-file write as one line (llmlab.core.errors.write_failure names the cause)."""
    reason = write_failure(err) or str(err).splitlines()[0][:160]
    return UserError(
        f"could not write {what}: {reason}; free space (or pick another --output_dir) and resume "
        "from the last checkpoint"
    )


def load_checkpoint(accelerator, path: str | os.PathLike) -> dict:
    """Restore model/optimizer/scheduler/scaler/RNG/registered objects from a verified checkpoint."""
    state = read_trainer_state(path)
    try:
        accelerator.load_state(str(path))
    except UserError:
        raise
    except Exception as err:  # torch/safetensors/pickle raise many types for a corrupt file
        raise UserError(
            f"checkpoint {path} is unreadable ({type(err).__name__}: {str(err).splitlines()[0][:160]}); "
            "resume from an older checkpoint folder"
        ) from None
    return state


def check_resume_config(saved: dict, current: dict, resumable: Iterable[str], path: Path) -> list[str]:
    """Options that changed since the checkpoint: honoured ones are returned, any other is refused by name."""
    resumable = set(resumable)
    changed = [k for k in current if k in saved and saved[k] != current[k]]
    refused = [k for k in changed if k not in resumable]
    if refused:
        name = refused[0]
        raise UserError(
            f"--{name} changed since checkpoint {path} ({saved[name]!r} -> {current[name]!r}); resume with "
            f"the same --{name}, or start a new run (a new --output_dir, or --overwrite_output_dir) to change "
            "it"
        )
    return changed


def check_layout(saved: dict, current: dict, path: Path, same: str) -> None:
    """What the config cannot show (process count, accumulation, dataset size, the identity of the data and base
    weights) must match too. A key an older checkpoint did not record cannot be checked and is skipped."""
    changed = [k for k in current if k in saved and saved[k] != current[k]]
    if changed:
        diff = ", ".join(f"{k} {saved[k]!r} -> {current[k]!r}" for k in changed)
        what = (
            "the data or the base model changed in place since this run started"
            if set(changed) & {"data", "base_model"}
            else "it was written with another setup"
        )
        raise UserError(f"checkpoint {path}: {what} ({diff}); resume with the same {same}, or start a new run")


def set_aside_newer_checkpoints(output_dir: str | os.PathLike, resume_path: Path) -> list[Path]:
    """Resuming from an older checkpoint starts a new timeline: checkpoints past it are renamed out of rotation
    (kept, never deleted), so neither `latest` nor retention can mix the two timelines."""
    step = checkpoint_step(resume_path)
    moved = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in list_checkpoints(output_dir):
        if checkpoint_step(path) > step:
            target = path.with_name(f"{path.name}.abandoned-{stamp}")
            os.replace(path, target)
            moved.append(target)
    return moved


class Checkpointer:
    """Owns the checkpoint cadence, from its CheckpointGroup: `maybe_save(step)` saves every `save_every` steps, and
    a save that falls where the trainer cannot save yet (e.g. in the middle of a loss spike) waits until it can."""

    def __init__(self, session, group: CheckpointGroup, model, extra_manifest, write_extra):
        self.session, self.save_every, self.keep_last, self.model = session, group.save_every, group.keep_last, model
        self.extra_manifest, self.write_extra, self.pending = extra_manifest, write_extra, False

    def due(self, step: int) -> bool:
        """A save is due at this step, or one was held back (mid-spike) and waits for the first allowed step."""
        return self.pending or (self.save_every > 0 and step % self.save_every == 0)

    def maybe_save(self, step: int, allowed: bool = True) -> Optional[Path]:
        self.pending = self.due(step)
        if not (self.pending and allowed):
            return None
        self.pending = False
        return self.save(step)

    def save(self, step: int) -> Path:
        session = self.session
        manifest = {
            "step": step,
            "config": to_dict(session.cfg),
            "layout": session.layout,
            "trainer": {**session.state.state_dict(), **(self.extra_manifest() if self.extra_manifest else {})},
        }
        with session.meter.paused():
            return save_checkpoint(
                session.accelerator,
                session.out,
                step,
                manifest,
                self.keep_last,
                model=self.model,
                write_extra=self.write_extra,
            )
