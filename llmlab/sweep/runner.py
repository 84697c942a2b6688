"""The sweep parent: prepare data once, write the design, run each trial in its own process, resume, report.

The trials reach their processes through a launcher (llmlab.sweep.launchers): this machine's fork server or fresh
interpreters, or the nodes of a Ray cluster. Resume, results.csv and the report never depend on which.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Optional

import numpy as np

from llmlab.core.device import resolve_device, resolve_precision
from llmlab.core.errors import Interrupted, UserError, Waiting
from llmlab.core.io import atomic_write_json, atomic_write_text, progress_bar
from llmlab.core.runfolder import check_output_dir, claim_run_folder, process_start_time, release_lock
from llmlab.core.runinfo import write_run_info
from llmlab.data.prepare import DataConfig, prepare_dataset
from llmlab.data.tokenizer import load_tokenizer
from llmlab.models.minimal import MinimalTransformer, MinimalTransformerConfig, parameter_table
from llmlab.sweep import report
from llmlab.sweep.config import FULL_NOMINAL_STEPS, SweepConfig
from llmlab.sweep.design import base_design, build_design, design_table, parse_size, run_order, size_steps
from llmlab.sweep.factors import resolve
from llmlab.sweep.launchers import LAUNCHERS, SPLITS, load_target, save_token_arrays
from llmlab.sweep.spec import Hparams, TrialSpec, load_results
from llmlab.train.config import parse_clip

FINISHED = ("ok", "failed", "oom")


# ---------------------------------------------------------------- data
def prepare_data(cfg: SweepConfig, out_dir: Path) -> dict:
    """Tokenise and pack once (llmlab.data.prepare cache), then export token arrays the trials memory-map."""
    budget = cfg.budget_spec
    block = cfg.block_size or budget.block_size
    key = {
        "dataset": cfg.dataset,
        "block_size": block,
        "max_documents": cfg.max_documents or budget.max_documents,
        "max_train_tokens": budget.max_train_tokens,
    }
    if cfg.dataset_config or cfg.text_field != "text":  # left out at their defaults: earlier sweeps' keys stay valid
        key.update(dataset_config=cfg.dataset_config, text_field=cfg.text_field)
    data_dir = out_dir / "data"
    info_path = data_dir / "data.json"
    cached = _cached_data(info_path, key)
    if cached is not None:
        return cached
    extra = {"cache_dir": cfg.data_cache_dir} if cfg.data_cache_dir else {}
    data_cfg = DataConfig(
        dataset=cfg.dataset,
        dataset_config=cfg.dataset_config,
        text_field=cfg.text_field,
        block_size=block,
        max_documents=key["max_documents"],
        **extra,
    )
    prepared = prepare_dataset(data_cfg, load_tokenizer())
    arrays = {}
    for split, dataset in zip(SPLITS, (prepared.train, prepared.validation)):
        tokens = np.asarray(dataset.with_format("numpy")["input_ids"]).reshape(len(dataset), block)
        if split == "train" and budget.max_train_tokens:
            tokens = tokens[: max(1, budget.max_train_tokens // block)]
        if not len(tokens):
            raise UserError(
                f"the {split} split of {cfg.dataset} has no block of {block} tokens; use more "
                "documents (--max_documents) or a smaller --block_size"
            )
        arrays[split] = tokens.astype(np.uint16 if tokens.max() < 2**16 else np.int32)
    save_token_arrays(data_dir, arrays, "free space or pick another --output_dir")
    info = {
        "key": key,
        "cache_path": str(prepared.cache_path),
        "block_size": block,
        "train_rows": len(arrays["train"]),
        "validation_rows": len(arrays["validation"]),
        "train_tokens": int(arrays["train"].size),
    }
    atomic_write_json(info_path, info)
    return info


def _cached_data(info_path: Path, key: dict) -> Optional[dict]:
    """The exported arrays of an earlier run with the same data settings, if they are whole."""
    if not info_path.is_file():
        return None
    try:
        info = json.loads(info_path.read_text())
        if info.get("key") != key:
            return None
        rows = {split: len(np.load(info_path.parent / f"{split}.npy", mmap_mode="r")) for split in SPLITS}
        whole = rows == {"train": info["train_rows"], "validation": info["validation_rows"]}
    except (OSError, ValueError, KeyError) as err:
        whole, rows = False, str(err).splitlines()[0][:120]
    if not whole:
        print(f"note: the prepared data in {info_path.parent} is damaged ({rows}); preparing it again", flush=True)
        return None
    return info


# ---------------------------------------------------------------- specs
def trial_specs(
    cfg: SweepConfig, design: list[dict], data_info: dict, out_dir: Path, precision: Optional[str] = None
) -> list[TrialSpec]:
    """One spec per design point; `precision`: a scan's pinned precision instead of what this machine would pick."""
    budget = cfg.budget_spec
    device, resolved = trial_device(cfg)
    precision = precision or resolved
    shared = dict(
        data_dir=str(out_dir / "data"),
        model=cfg.model,
        embedding=cfg.embedding,
        gradient_checkpointing=cfg.gradient_checkpointing,
        block_size=data_info["block_size"],
        eval_batch_size=budget.batch_size,
        eval_batches=budget.eval_batches,
        log_every=budget.log_every,
        fail_loss=cfg.fail_loss,
        fail_margin=cfg.fail_margin,
        fail_grad_norm=cfg.fail_grad_norm,
        flat_tolerance=cfg.flat_tolerance,
        flat_window=cfg.flat_window,
        precheck_steps=cfg.precheck_steps,
        retry=cfg.retry,
        timeout_s=cfg.trial_timeout or budget.trial_timeout,
        device=device,
        precision=precision,
        compile=cfg.budget != "smoke" if cfg.compile is None else cfg.compile,
        parametrization=cfg.parametrization,
        mup_base_width=cfg.mup_base_width,
        head_dim=cfg.head_dim,
        report_to=cfg.report_to,
    )
    steps = trial_steps(cfg, data_info)
    specs = []
    for trial in design:
        hp = trial_hparams(cfg, trial)
        # a WIDTHxDEPTH@STEPS size trains its own steps (a scan across lengths); warmup keeps its share of them
        run_steps = size_steps(hp.size) or steps or max(1, budget.epochs * data_info["train_rows"] // hp.batch_size)
        micro = cfg.micro_batch_size or (hp.batch_size if cfg.grid == "lr_bs" else budget.batch_size)
        width, depth = parse_size(hp.size, cfg.model, cfg.head_dim) if hp.size else default_shape(cfg)
        spec = TrialSpec(
            **shared,
            trial_id=trial["trial_id"],
            trial_dir=str(out_dir / "trials" / trial["trial_id"]),
            model_width=width,
            model_depth=depth,
            hparams=hp,
            seed=trial["seed"],
            replicate=trial["replicate"],
            steps=run_steps,
            micro_batch_size=micro,
            warmup_scale=warmup_scale(cfg, run_steps),
            registration=trial.get("registration"),
        )
        check_runnable(spec)
        specs.append(spec)
    return specs


def default_shape(cfg: SweepConfig) -> tuple[Optional[int], Optional[int]]:
    """Width and depth of a trial that names no size: the budget's (heads of --head_dim; for `--model gpt2`, the
    budget's GPT-2 probe), else the model's own."""
    if cfg.model == "gpt2" and cfg.budget_spec.gpt2_probe:
        return cfg.budget_spec.gpt2_probe
    shape = cfg.budget_spec.default_shape
    if cfg.model != "minimal" or shape is None:
        return None, None
    heads, depth = shape
    return heads * cfg.head_dim, depth


def trial_device(cfg: SweepConfig) -> tuple[str, str]:
    """Device and precision of every trial. Ray trials run on other machines: GPUs are what --gpus_per_trial
    reserves, and the driver, which may have none, cannot pick their precision."""
    if cfg.launcher == "auto" or not LAUNCHERS[cfg.launcher].remote:
        device = resolve_device(cfg.device)
        return device, resolve_precision(cfg.precision, device)
    if cfg.gpus_per_trial > 0:
        return "cuda", cfg.precision  # named explicitly (SweepConfig refuses auto here)
    return "cpu", resolve_precision(cfg.precision, "cpu")  # auto: what this (the driver's) CPU does fast


def check_runnable(spec: TrialSpec) -> None:
    """Refuse, before any trial starts, a design point that cannot be what it says."""
    hp = spec.hparams
    warmup = max(0, round(hp.warmup * spec.warmup_scale))
    if warmup >= spec.steps:
        raise UserError(
            f"trial {spec.trial_id}: warmup {hp.warmup} scales to {warmup} steps, not below its {spec.steps} "
            "steps, so its lr would never reach its peak; lower the warmup level or train longer"
        )
    if hp.batch_size % hp.accumulation:
        raise UserError(
            f"trial {spec.trial_id}: batch_size {hp.batch_size} is not a multiple of accumulation "
            f"{hp.accumulation}; pick levels whose micro batch is whole"
        )


def trial_steps(cfg: SweepConfig, data_info: dict) -> Optional[int]:
    """Optimizer steps of every trial, or None when they follow from the data (the full budget's epochs)."""
    return cfg.steps or (200 if cfg.grid == "lr_bs" and cfg.budget != "smoke" else cfg.budget_spec.steps)


def warmup_note(specs: list[TrialSpec]) -> str:
    """What a design table's warmup column means when the budget scales it (a reader would take it for steps)."""
    scaled = next((s for s in specs if s.warmup_scale != 1.0), None)
    if scaled is None:
        return ""
    return (
        f"\n\nWarmup levels are steps of the full protocol ({FULL_NOMINAL_STEPS} steps); these trials train "
        f"{scaled.steps}, so each level scales by {scaled.warmup_scale:.3g} (a level of 500 warms up for "
        f"{round(500 * scaled.warmup_scale)} steps)."
    )


def warmup_scale(cfg: SweepConfig, steps: int) -> float:
    """Warmup levels are steps of the full protocol (FULL_NOMINAL_STEPS); a run of other length scales them so
    warmup keeps its share of training. --no-scale_warmup keeps them as steps."""
    return steps / FULL_NOMINAL_STEPS if cfg.scale_warmup else 1.0


def as_run(cfg: SweepConfig, trial: dict) -> dict:
    """A design point with the sweep-wide settings that override its levels (an lr scan's --clip applies to every
    point), so the design written to design.md shows what the trial trains with."""
    if cfg.grid == "lr_bs" and cfg.clip is not None:
        return {**trial, "clip": parse_clip(cfg.clip)}
    return trial


def trial_hparams(cfg: SweepConfig, trial: dict) -> Hparams:
    """The levels one trial trains with: its design values, then the sweep-wide defaults (llmlab.sweep.factors)."""
    return Hparams(**resolve(cfg, as_run(cfg, trial)))


class Study:
    """What a kind of sweep adds to the runner, so that the runner never asks which kind it runs. This one is the
    lab's fixed designs (doe20, YAML grids): the whole design, built from the options, runs once, and the lab's report
    is the analysis. The scaling study (llmlab.scaling.scan.study_for) analyses an lr x batch grid with its fits, and
    a multi-size scan plans its grids as it runs."""

    growth_options: frozenset = frozenset()  # options a rerun may change to grow the sweep: not in its fingerprint
    plans_as_it_runs = False  # the design is read back from the study's own plan, not built from the options

    def precision(self, cfg: SweepConfig, out_dir: Path) -> Optional[str]:
        """A precision pinned for every trial before anything is written (None: each trial resolves its own)."""
        return None

    def design(self, cfg: SweepConfig, out_dir: Path) -> list[dict]:
        return build_design(cfg)

    def run(self, cfg, out_dir: Path, design: list[dict], precision, run_design, finished, replay) -> list[dict]:
        """Run the sweep: `run_design(design)` runs what is pending and returns every finished row, `finished(design)`
        only returns them, `replay(trial, folder)` runs one trial again in another folder."""
        return run_design(design, announce=True)

    def analyse(self, cfg: SweepConfig, out_dir: Path, rows: list[dict]) -> None:
        """What the study adds to report.md, which every sweep writes."""


# Options whose default changed after sweeps were fingerprinted, at the default those sweeps left out: a folder keeps
# its fingerprint (--model was minimal before lr_bs probes became GPT-2; --mup_base_width was 192).
FINGERPRINT_DEFAULTS = {"model": "minimal", "mup_base_width": 192}


def settings_fingerprint(cfg: SweepConfig, before_growth: bool = False, study: Optional[Study] = None) -> str:
    """What must match for a rerun to resume rather than mix two different sweeps in one folder. Replication is
    left out: adding replicates to a finished sweep runs only the new ones. `before_growth`: the fingerprint scans
    wrote before they could grow (it held the growth options too), which such a folder still resumes with."""
    # options declared with outcome=False (where and how trials run, what is reported) change no trial's numbers
    ignore = {f.name for f in fields(SweepConfig) if f.metadata.get("outcome") is False}
    study = study or Study()
    if study.plans_as_it_runs and not before_growth:
        ignore |= study.growth_options
    defaults = {**asdict(SweepConfig()), **FINGERPRINT_DEFAULTS}
    # Options at their default are left out, so a new option added to llmlab never orphans an existing sweep.
    settings = {k: v for k, v in asdict(cfg).items() if k not in ignore and v != defaults.get(k)}
    design = (
        None
        if study.plans_as_it_runs
        else base_design(
            cfg.grid, lrs=cfg.lrs, batch_sizes=cfg.batch_sizes, model=cfg.model, seed=cfg.seed, sizes=cfg.sizes
        )[0]
    )
    return hashlib.sha256(json.dumps([settings, design], sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the sweep
def read_sweep_state(state_path: Path) -> Optional[dict]:
    if not state_path.is_file():
        return None
    try:
        state = json.loads(state_path.read_text())
        if not isinstance(state, dict):
            raise ValueError("not a sweep state")
        return state
    except (ValueError, UnicodeDecodeError):
        raise UserError(
            f"{state_path} is damaged, so this folder's settings are unknown; if it holds the sweep you "
            f"are rerunning, delete {state_path.name} to adopt its finished trials, else pick a new "
            "--output_dir"
        ) from None


def run_sweep(cfg: SweepConfig, study: Optional[Study] = None) -> list[dict]:
    """Run (or resume) the sweep `cfg` describes as `study` runs it: the lab's fixed designs by default; an lr scan
    needs the scaling study, `llmlab.scaling.scan.study_for(cfg)` (sweep.py passes it)."""
    if study is None and cfg.grid == "lr_bs":
        raise ValueError("an lr_bs sweep is the scaling study's: pass llmlab.scaling.scan.study_for(cfg)")
    study = study or Study()
    out_dir = check_output_dir(cfg.output_dir)
    design = [] if study.plans_as_it_runs else study.design(cfg, out_dir)
    check = None if cfg.launcher == "auto" else LAUNCHERS[cfg.launcher].check
    if check and not cfg.report_only:
        load_target(check)(cfg)  # e.g. no Ray cluster: one line, before anything is written
    precision = None if cfg.report_only else study.precision(cfg, out_dir)  # refusals come before anything is written
    # one driver per folder (a second would run every trial twice), and never in another kind of run's folder
    _, note = claim_run_folder(out_dir, (), resume=True, overwrite=False, what="sweep")
    try:
        if note:
            print(note, flush=True)
        reap_stale_trials(out_dir)
        fingerprint = settings_fingerprint(cfg, study=study)
        state = read_sweep_state(out_dir / "sweep.json")
        known = {fingerprint, settings_fingerprint(cfg, before_growth=True, study=study)}
        if state is not None and state.get("fingerprint") not in known:
            raise UserError(
                f"{out_dir} holds a sweep with different settings; rerun with its original options to "
                "resume, or pick a new --output_dir"
            )
        if cfg.report_only:
            design = study.design(cfg, out_dir) if study.plans_as_it_runs else design
            rows = load_results(out_dir, design, rerun=False)
            if not rows:
                raise UserError(f"{out_dir} has no finished trials to report on; run the sweep first")
        else:
            try:
                rows = _run_trials(cfg, study, design, out_dir, fingerprint, precision)
            except Waiting:  # e.g. a registration to commit: the report and fits say what the finished trials say
                design = study.design(cfg, out_dir) if study.plans_as_it_runs else design
                _report(cfg, study, out_dir, design, load_results(out_dir, design, rerun=False))
                raise
            design = study.design(cfg, out_dir) if study.plans_as_it_runs else design
        _report(cfg, study, out_dir, design, rows)
        return rows
    finally:
        release_lock(out_dir)


def _report(cfg: SweepConfig, study: Study, out_dir: Path, design: list[dict], rows: list[dict]) -> None:
    report.write_report(out_dir, [as_run(cfg, trial) for trial in design], rows, cfg)
    study.analyse(cfg, out_dir, rows)


def _run_trials(
    cfg: SweepConfig, study: Study, design: list[dict], out_dir: Path, fingerprint: str, precision: Optional[str] = None
) -> list[dict]:
    atomic_write_json(out_dir / "sweep.json", {"fingerprint": fingerprint, "grid": cfg.grid, "budget": cfg.budget})
    write_run_info(out_dir, cfg)
    _print_parameters(cfg)
    name = cfg.launcher
    if name == "auto":  # CUDA cannot be used in a child forked after CUDA init: spawn fresh processes there
        name = "spawn" if resolve_device(cfg.device) == "cuda" else "forkserver"
    entry = LAUNCHERS[name]
    if entry.warm:
        load_target(entry.warm)()  # e.g. the fork server imports torch while the data is prepared
    data_info = prepare_data(cfg, out_dir)
    launch = load_target(entry.factory)(cfg, out_dir, name)  # imported only when chosen (Ray's takes seconds)

    def run_design(design: list[dict], announce: bool = False) -> list[dict]:
        """Write the design, run its pending trials, return every finished result."""
        design = [as_run(cfg, trial) for trial in design]
        if announce:
            print(f"design ({cfg.grid}, {len(design)} trials):\n{design_table(design)}", flush=True)
        specs = trial_specs(cfg, run_order(design), data_info, out_dir, precision)
        atomic_write_text(out_dir / "design.md", design_table(design) + warmup_note(specs) + "\n")
        atomic_write_json(out_dir / "design.json", design)
        done = {
            r["trial_id"]: r
            for r in load_results(out_dir, design)
            if r.get("status") in FINISHED or (r.get("status") in ("crashed", "timeout") and not cfg.rerun_crashed)
        }
        pending = [s for s in specs if s.trial_id not in done]
        if done:
            names = f" ({', '.join(sorted(done))})" if announce else ""
            print(f"resuming: {len(done)} finished trial(s) skipped{names}; {len(pending)} to run", flush=True)
        if pending:
            _launch_all(launch, pending, len(specs), len(done))
        return load_results(out_dir, design)

    def replay(trial: dict, folder: Path) -> dict:
        """One finished trial again, in another folder (a new machine's test of its numerics)."""
        spec = trial_specs(cfg, [trial], data_info, out_dir, precision)[0]
        return launch.run(replace(spec, trial_dir=str(folder)), 0)

    return study.run(cfg, out_dir, design, precision, run_design, lambda design: load_results(out_dir, design), replay)


def _launch_all(launch, pending: list[dict], total: int, done: int) -> None:
    slots = list(range(launch.workers))
    slot_lock = threading.Lock()
    bar = progress_bar(total=total, initial=done, desc="trials", unit="trial")

    def work(spec: TrialSpec) -> dict:
        with slot_lock:
            slot = slots.pop(0)
        try:
            result = launch.run(spec, slot)
        finally:
            with slot_lock:
                slots.append(slot)
        bar.update(1)
        bar.write(
            f"{spec.trial_id}: {result['status']}"
            + (f" final_loss={result['final_loss']:.4f}" if result.get("final_loss") is not None else "")
            + (f" ({'; '.join(result['failures'])})" if result.get("failures") else "")
        )
        return result

    pool = ThreadPoolExecutor(max_workers=launch.workers)
    try:
        list(pool.map(work, pending))
    except KeyboardInterrupt:
        launch.kill_all()
        pool.shutdown(wait=True, cancel_futures=True)
        raise Interrupted("rerun the same command to resume (finished trials are kept)") from None
    finally:
        pool.shutdown(wait=True)
        bar.close()


def reap_stale_trials(out_dir: Path) -> None:
    """Trials of an earlier driver of this folder that are still running (it was killed before they saw it)
    would write into this run's trial folders: kill them first. A trial folder's pid + pid_start name it."""
    for pid_file in (out_dir / "trials").glob("*/pid"):
        try:
            pid, started = int(pid_file.read_text()), (pid_file.parent / "pid_start").read_text().strip()
        except (OSError, ValueError):
            continue
        if process_start_time(pid) != started:
            continue  # gone, or the pid now belongs to someone else
        print(
            f"note: trial {pid_file.parent.name} (pid {pid}) of an earlier sweep is still running; stopping it",
            flush=True,
        )
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        deadline = time.time() + 30
        while process_start_time(pid) == started and time.time() < deadline:
            time.sleep(0.05)


def _print_parameters(cfg: SweepConfig) -> None:
    if cfg.model != "minimal":
        return
    options = dict(
        max_seq_len=cfg.block_size or cfg.budget_spec.block_size,
        position_encoding=cfg.position_encoding,
        embedding=cfg.embedding,
    )
    width, depth = default_shape(cfg)
    model = MinimalTransformer(MinimalTransformerConfig.of_size(width, depth, cfg.head_dim, **options))
    table, trainable, frozen = parameter_table(model)
    print(
        f"minimal Transformer ({cfg.position_encoding} positions, {cfg.embedding} embedding): {trainable:,} "
        f"trainable, {frozen:,} frozen parameters\n{table}",
        flush=True,
    )
