"""Training checkpoints: accelerate's save_state plus our trainer state, published atomically.

A checkpoint is output_dir/checkpoints/step_N. It is written under a temporary name and renamed into
place only when complete, so a run killed mid-save leaves at most a `.tmp-*` folder that is never loaded
(and is cleaned up on the next start). trainer_state.json, written last, lists every file with its size;
loading checks them, so a truncated or emptied checkpoint is refused with a clear error instead of
resuming from garbage.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_json, publish_dir

STATE_FILE = "trainer_state.json"
FORMAT = "llmlab-pretrain-checkpoint/1"
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


def resolve_checkpoint(output_dir: str | os.PathLike, value: str) -> Path:
    """`--resume_from_checkpoint latest|PATH` -> a checkpoint folder, or a UserError saying what to do."""
    if value == "latest":
        path = latest_checkpoint(output_dir)
        if path is None:
            raise UserError(f"--resume_from_checkpoint latest: no checkpoint in {checkpoints_dir(output_dir)}; "
                            "start without --resume_from_checkpoint, or pass a checkpoint folder")
        return path
    path = Path(value)
    if not path.is_dir():
        raise UserError(f"--resume_from_checkpoint: {path} is not a folder; pass 'latest' or a "
                        "checkpoints/step_N folder")
    return path


def read_trainer_state(path: str | os.PathLike) -> dict:
    """The trainer state of a checkpoint, after checking that the checkpoint is complete."""
    path = Path(path)
    state_file = path / STATE_FILE
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} is incomplete or not a checkpoint ({STATE_FILE} missing); "
                        "pass a checkpoints/step_N folder written by train_pretrain.py or train_lora.py") from None
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint {path} is unreadable ({STATE_FILE}: {err}); resume from an older "
                        "checkpoint folder") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} has an unknown format; it was not written by this version of llmlab")
    for rel, size in state.get("files", {}).items():
        file = path / rel
        if not file.is_file() or file.stat().st_size != size:
            raise UserError(f"checkpoint {path} is damaged ({rel} missing or truncated); resume from an "
                            "older checkpoint folder")
    return state


def _file_sizes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def save_checkpoint(accelerator, output_dir: str | os.PathLike, step: int, trainer_state: dict,
                    keep_last: int, write_extra: Callable[[Path], None] | None = None) -> Path:
    """Save everything needed to continue exactly; every process must call this.

    `write_extra(folder)` adds the trainer's own files (main process only) before the checkpoint is sealed."""
    root = checkpoints_dir(output_dir)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # model, optimizer, grad scaler, RNG states, registered scheduler
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if write_extra is not None:
            write_extra(tmp)
        state = {"format": FORMAT, **trainer_state, "files": _file_sizes(tmp)}
        atomic_write_json(tmp / STATE_FILE, state)
        publish_dir(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: str | os.PathLike, layout: dict, same: str) -> dict:
    """Restore model/optimizer/scheduler/scaler/RNG from `path`; returns its trainer state.

    `layout` is what must match between the checkpoint and this run (or the data position means something
    else); a mismatch is refused before anything is loaded, naming the options to keep (`same`)."""
    state = read_trainer_state(path)
    if state.get("layout") != layout:
        raise UserError(f"checkpoint {path} was written with {state.get('layout')}, this run has {layout}; "
                        f"resume with the same {same}")
    try:
        accelerator.load_state(str(path))
    except UserError:
        raise
    except Exception as err:  # torch/safetensors/pickle raise many types for a corrupt file
        raise UserError(f"checkpoint {path} is unreadable ({type(err).__name__}: {str(err).splitlines()[0][:160]}); "
                        "resume from an older checkpoint folder") from None
    return state
