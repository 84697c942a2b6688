"""The sweep's typed config and its three budgets (smoke / cpu / full)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Optional

from llmlab.core.config import check_report_to, opt
from llmlab.core.errors import UserError
from llmlab.models.gpt2 import GPT2_PRESETS
from llmlab.sweep.design import parse_size, size_steps
from llmlab.sweep.launchers import LAUNCHERS, LauncherChoices
from llmlab.train.config import parse_clip


@dataclass(frozen=True)
class Budget:
    steps: Optional[int]  # None: derived from the data (epochs x blocks / batch)
    batch_size: int
    block_size: int
    max_documents: Optional[int]
    max_train_tokens: Optional[int]
    epochs: int
    eval_batches: int
    log_every: int
    trial_timeout: int  # seconds
    # (heads, blocks) of the minimal model where a trial names no size (None: the model's own 192x4)
    default_shape: Optional[tuple[int, int]] = None
    # (width, layers) of a `--model gpt2` trial that names no size: the lab's GPT-2 probe (None: the 124M preset)
    gpt2_probe: Optional[tuple[int, int]] = None


# Warmup levels (100 / 500 / 1000) are steps of the full protocol; smaller budgets scale them by
# steps / FULL_NOMINAL_STEPS so warmup keeps the same share of training. 10 MB of text is about
# 2.4M GPT-2 tokens = 4,600 blocks of 512; 3 epochs at batch 8 is about 1,800 steps.
FULL_NOMINAL_STEPS = 1800

BUDGETS: dict[str, Budget] = {
    # The plumbing only: a doe20 of 20 trials with 2 workers in ~1-2 minutes on 2 cores.
    "smoke": Budget(
        steps=8,
        batch_size=2,
        block_size=32,
        max_documents=40,
        max_train_tokens=None,
        epochs=1,
        eval_batches=2,
        log_every=2,
        trial_timeout=180,
        # 2 heads and 2 blocks (64x2 at --head_dim 32): the plumbing does not need 192x4's compute
        default_shape=(2, 2),
        gpt2_probe=(64, 2),
    ),
    # A doe20 in about an hour on 2 cores (2 workers of one core, 2-5 minutes a trial).
    "cpu": Budget(
        steps=200,
        batch_size=4,
        block_size=128,
        max_documents=100,
        max_train_tokens=None,
        epochs=1,
        eval_batches=8,
        log_every=10,
        trial_timeout=1200,
        # GPT-2 124M's depth (12) and heads (64 wide) at the muP base width 128: the probe whose lr transfers to it
        gpt2_probe=(128, 12),
    ),
    # The reference protocol for a GPU: ~10 MB of text, sequences of 512, 3 epochs.
    "full": Budget(
        steps=None,
        batch_size=8,
        block_size=512,
        max_documents=None,
        max_train_tokens=2_400_000,
        epochs=3,
        eval_batches=20,
        log_every=20,
        trial_timeout=7200,
    ),
}


@dataclass
class SweepConfig:
    grid: str = opt(
        "doe20",
        "doe20 (control + 19 balanced Latin-hypercube points), lr_bs (learning rate x "
        "batch size), or a YAML file with `trials:` or `factorial:`",
    )
    output_dir: str = opt("runs/sweep", "sweep folder: design, trials/, results.csv, report.md, plots/", outcome=False)
    budget: Literal["smoke", "cpu", "full"] = opt(
        "cpu",
        "smoke: seconds per trial (tests); cpu: doe20 in ~1 h on 2 cores; full: ~10 MB text, seq 512, 3 epochs (GPU)",
    )
    workers: int = opt(
        1,
        "trials run at once, each in its own subprocess (one GPU each when GPUs exist); "
        "--launcher ray: the cluster's CPUs / --cpus_per_trial instead",
        outcome=False,
    )
    model: str = opt(
        "auto",
        "auto = gpt2 for --grid lr_bs (the probe shares the architecture the trainers train), minimal otherwise; "
        "minimal (the lab's minimal Transformer) or a GPT-2 preset: gpt2-tiny, gpt2, ... (gpt2 names the family: "
        "a trial that names no size trains the budget's probe, smoke 64x2, cpu 128x12, full the 124M model)",
    )
    position_encoding: Literal["sinusoidal", "learned", "rope"] = opt(
        "rope",
        "minimal model's positions (YAML grids "
        "may vary it per trial); sinusoidal is the "
        "original lab design (see README)",
    )
    embedding: Literal["trainable", "frozen"] = opt(
        "trainable",
        "minimal model's token embedding, tied to the output "
        "head: trainable, or frozen (the original lab design, which "
        "stays near the uniform guess at the cpu budget; see README)",
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = opt(
        "auto",
        "trial compute: auto = bf16 autocast on CPUs with AVX512-BF16/AMX and on bf16 GPUs, fp16 + loss "
        "scaling on older GPUs, else fp32",
    )
    compile: Optional[bool] = opt(
        None,
        "torch.compile each trial's forward + loss (a one-off ~10-45 s per trial, "
        "about 1.6x faster steps); unset = on except at the smoke budget",
    )
    gradient_checkpointing: bool = opt(False, "recompute each block in backward to save memory")
    lr: Optional[float] = opt(
        None,
        "peak learning rate of AdamW/Adafactor (Lion uses lr/3, weight decay x3); "
        "default 1e-3 for the minimal model, 2e-5 for GPT-2 presets",
    )
    lrs: Optional[list[float]] = opt(
        None,
        "lr_bs: learning rates to scan (default 1e-4 3e-4 1e-3 3e-3 for the "
        "minimal model, 5e-6 1e-5 2e-5 3e-5 for GPT-2 presets)",
    )
    batch_sizes: Optional[list[int]] = opt(
        None, "lr_bs: effective batch sizes to scan (default 8 16 32 64 128; with --sizes 4 8)"
    )
    sizes: Optional[list[str]] = opt(
        None,
        "lr_bs: model sizes WIDTHxDEPTH of --model's family to scan (e.g. 64x2 "
        "128x2 256x2), or `default` (32x2 64x2 96x2 128x2 160x2 + 320x2 held "
        "out); an adaptive scan that fits ln lr_opt = k0 + alpha ln N across them",
    )
    lr_points: int = opt(7, "multi-size scans: lrs per size, centred on the running forecast")
    lr_step: float = opt(2**0.5, "multi-size scans: ratio between neighbouring lrs of a size's grid")
    lr_center: Optional[float] = opt(
        None,
        "multi-size scans: centre of the first size's grid (default 3e-3 for the "
        "minimal model, 1e-3 for GPT-2 presets); later sizes use the running forecast",
    )
    max_lr_extensions: int = opt(
        3, "multi-size scans: times a size's grid may be extended past an edge where its seed-mean minimum lies"
    )
    holdout: Literal["auto", "largest", "none"] = opt(
        "auto",
        "multi-size scans: fit on the smaller sizes and check the forecast on the largest (auto: when >= 3 sizes)",
    )
    holdout_lr_points: Optional[int] = opt(
        None, "multi-size scans: lrs of the held-out size's grid (default --lr_points)"
    )
    holdout_replicates: Optional[int] = opt(
        None, "multi-size scans: seeds per lr at the held-out size (default --replicates)"
    )
    blind_to: list[str] = opt(
        ["docs/findings"],
        "multi-size scans: folders whose trials the held-out forecast must not have seen; the pre-registration is "
        "refused if any trial of the held-out size (same model) exists under them or in the scan's own folder",
        outcome=False,
    )
    registration_check: Literal["commit", "none"] = opt(
        "commit",
        "multi-size scans: commit = the held-out trials start only once preregistration.json is committed to git as "
        "it is on disk (blind by rule; each held-out result.json records that commit); none = outside git, blind "
        "by timing only, and the results say so",
        outcome=False,
    )
    design_rationale: Optional[str] = opt(
        None,
        "multi-size scans: a JSON file (e.g. bench/forecast_design.py's "
        "choice and its simulated error rates) copied into the "
        "pre-registration the scan writes before its held-out trials",
    )
    parametrization: Literal["standard", "mup"] = opt(
        "standard",
        "standard, or muP (maximal update: width-scaled init, readout and Adam lr) for the minimal Transformer and "
        "GPT-2 alike",
    )
    mup_base_width: Optional[int] = opt(
        None,
        "muP: the width at which muP equals the standard parametrization (default 192 for the minimal "
        "Transformer, 128 for GPT-2: the width of the cpu budget's GPT-2 probe)",
    )
    head_dim: int = opt(
        32,
        "minimal model: width of each attention head; every size's width is a multiple of it "
        "(16 allows the widths 48, 80, 112, 144 between the default sizes)",
    )
    micro_batch_size: Optional[int] = opt(
        None,
        "largest batch per forward pass; bigger batches use gradient "
        "accumulation (default: lr_bs: the trial's batch, so memory is measured at "
        "every batch size; otherwise the budget's batch size)",
    )
    steps: Optional[int] = opt(None, "optimizer steps per trial (default: the budget's; lr_bs: 200, smoke: 16)")
    batch_size: Optional[int] = opt(None, "batch size of doe20/YAML trials (default: the budget's)")
    block_size: Optional[int] = opt(None, "tokens per sequence (default: the budget's: 32 / 128 / 512)")
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy loss")
    clip: Optional[str] = opt(None, "lr_bs: max grad norm (number, 0 = off, or 'adaptive'); default 1.0")
    scale_warmup: bool = opt(True, "scale warmup levels (steps of the full protocol) to the budget's steps")
    seed: int = opt(42, "seed of every trial (model init, data order) and of the Latin hypercube")
    replicates: Optional[int] = opt(
        None,
        "runs of the reference trial (the control) with seeds seed, seed+1, ... "
        "(model init and data order; the data split stays fixed): the noise floor "
        "every effect is judged against; default 6 for doe20, 2 seeds at every lr of a "
        "multi-size lr_bs scan, else 1; a YAML grid may set `replicates:`",
        outcome=False,
    )
    replicate_all: bool = opt(False, "replicate every design point, not only the reference", outcome=False)
    new_machine_blocks: int = opt(
        1,
        "multi-size scan resumed on a machine whose replay of a finished trial is not "
        "bit-identical: complete blocks (one seed of a size's whole lr grid) it adds to "
        "each size it finds part-done (none part-done: to the last fit size that ran, a "
        "bridge), so its machine term is estimable",
        outcome=False,
    )
    launcher: str = opt(
        "auto",
        "auto = spawn with CUDA, else forkserver; "
        + "; ".join(f"{name}: {entry.help}" for name, entry in LAUNCHERS.items()),
        choices=LauncherChoices(),
        outcome=False,
    )
    ray_address: str = opt(
        "auto",
        "--launcher ray: the cluster to join, auto (the one `ray start` runs on this machine) or HEAD_IP:PORT",
        outcome=False,
    )
    cpus_per_trial: float = opt(1.0, "--launcher ray: CPUs each trial reserves (and its torch threads)", outcome=False)
    gpus_per_trial: float = opt(0.0, "--launcher ray: GPUs each trial reserves (fractions share a GPU)", outcome=False)
    node_retries: int = opt(
        2, "--launcher ray: times a trial whose node or Ray worker died is started again on another node", outcome=False
    )
    threads_per_worker: int = opt(
        0, "CPU threads per trial; 0 = cores / workers (on a busy machine 1 is often faster)", outcome=False
    )
    trial_timeout: Optional[int] = opt(None, "seconds before a trial is killed (default: the budget's)", outcome=False)
    rerun_crashed: bool = opt(True, "on resume, rerun trials recorded as crashed or timed out", outcome=False)
    fail_loss: Optional[float] = opt(
        None,
        "fail-safe: stop when the 10-step moving average of the loss exceeds "
        "this; unset = the first step's loss + 1 (worse than untrained)",
    )
    fail_margin: float = opt(
        1.0,
        "fail-safe: stop when the 10-step moving average of the loss rises more than "
        "this many nats above its best (noise moves that average by hundredths)",
    )
    fail_grad_norm: float = opt(1000.0, "fail-safe: stop when the pre-clip gradient norm exceeds this")
    flat_tolerance: float = opt(1e-5, "fail-safe: stop when the probe-batch loss moved less than this ...")
    flat_window: int = opt(100, "... over this many steps")
    precheck_steps: int = opt(10, "steps of the pre-check (finite loss/gradients, projected time within timeout)")
    retry: bool = opt(True, "retry a failed trial once with a fallback (clip - 0.1 or warmup 100)")
    target_loss: Optional[float] = opt(
        None, "loss for 'steps to target' (default: 90 percent of the control's loss drop)", outcome=False
    )
    dataset: str = opt(
        "builtin:wiki",
        "corpus (see llmlab.data.prepare): builtin:wiki, local files or a hub dataset "
        "(the full protocol: --dataset wikitext --dataset_config wikitext-103-raw-v1)",
    )
    dataset_config: Optional[str] = opt(None, "hub dataset configuration name, e.g. wikitext-103-raw-v1")
    text_field: str = opt("text", "field holding the text in .jsonl files and hub datasets")
    max_documents: Optional[int] = opt(None, "use only the first N documents (default: the budget's)")
    data_cache_dir: Optional[str] = opt(None, "prepared-data cache folder (default: llmlab's cache)", outcome=False)
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "where trials run; auto = CUDA when available", outcome=False)
    report_to: list[str] = opt(
        ["tensorboard"],
        "each trial's trackers, as the trainers' --report_to: tensorboard, "
        "wandb, mlflow, aim, comet_ml, all or none (metrics.jsonl is always "
        "written)",
        outcome=False,
    )
    report_only: bool = opt(False, "only rebuild report.md, results.csv and plots from finished trials", outcome=False)

    def resolved(self) -> "SweepConfig":
        """The config with its derived defaults (the probe model, muP's base width), checked; this one unchanged."""
        model = self.model if self.model != "auto" else ("gpt2" if self.grid == "lr_bs" else "minimal")
        base = self.mup_base_width or (192 if model == "minimal" else 128)
        cfg = replace(self, model=model, mup_base_width=base)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        check_report_to(self.report_to)  # an unknown or missing tracker fails before any trial starts
        if self.mup_base_width < 32 or self.mup_base_width % 32:
            raise UserError(f"--mup_base_width must be a multiple of 32, got {self.mup_base_width}")
        if self.head_dim < 8 or self.head_dim % 8:
            raise UserError(f"--head_dim must be a multiple of 8 (rotary positions pair channels), got {self.head_dim}")
        if self.threads_per_worker < 0:
            raise UserError(f"--threads_per_worker must be >= 0 (0 = automatic), got {self.threads_per_worker}")
        if self.replicates is not None and self.replicates < 1:
            raise UserError(f"--replicates must be >= 1, got {self.replicates}")
        if self.new_machine_blocks < 1:
            raise UserError(f"--new_machine_blocks must be >= 1, got {self.new_machine_blocks}")
        if not self.fail_margin > 0 or (self.fail_loss is not None and not math.isfinite(self.fail_loss)):
            raise UserError("--fail_margin must be > 0 and --fail_loss a finite number")
        if self.workers < 1:
            raise UserError(f"--workers must be >= 1, got {self.workers}")
        if not (self.cpus_per_trial > 0 and self.gpus_per_trial >= 0 and self.node_retries >= 0):
            raise UserError(
                f"--cpus_per_trial must be > 0, --gpus_per_trial and --node_retries >= 0; got "
                f"{self.cpus_per_trial}, {self.gpus_per_trial}, {self.node_retries}"
            )
        if (
            self.launcher != "auto"
            and LAUNCHERS[self.launcher].remote
            and self.gpus_per_trial > 0
            and (self.precision == "auto")
        ):
            raise UserError(
                "--launcher ray with --gpus_per_trial: pass --precision bf16, fp16 or fp32 (the driver "
                "cannot see the nodes' GPUs to choose)"
            )
        for name in ("steps", "batch_size", "block_size", "micro_batch_size", "trial_timeout", "max_documents"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name} must be >= 1, got {value}")
        if self.batch_sizes is not None and (not self.batch_sizes or any(b < 1 for b in self.batch_sizes)):
            raise UserError("--batch_sizes must be one or more whole numbers >= 1")
        if self.sizes is not None:
            self.validate_sizes()
        if self.lr_points < 5 or not self.lr_step > 1 or not math.isfinite(self.lr_step) or self.max_lr_extensions < 0:
            raise UserError(
                "--lr_points must be >= 5 (the vertex is fitted on 5 lrs), --lr_step a finite ratio > 1 "
                "and --max_lr_extensions >= 0"
            )
        if self.lr_center is not None and not (math.isfinite(self.lr_center) and self.lr_center > 0):
            raise UserError(f"--lr_center must be a learning rate > 0, got {self.lr_center}")
        if self.lrs is not None and (not self.lrs or any(lr <= 0 for lr in self.lrs)):
            raise UserError("--lrs must be one or more learning rates > 0")
        if self.lr is not None and self.lr < 0:
            raise UserError(f"--lr must be >= 0, got {self.lr}")
        if self.clip is not None:
            parse_clip(self.clip)
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"--label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.flat_window < 2 or self.precheck_steps < 1:
            raise UserError("--flat_window must be >= 2 and --precheck_steps >= 1")
        if self.model != "minimal":
            if self.model not in GPT2_PRESETS:
                raise UserError(f"--model {self.model!r} is unknown; use minimal or one of {', '.join(GPT2_PRESETS)}")

    def validate_sizes(self) -> None:
        if self.grid != "lr_bs":
            raise UserError("--sizes belongs to --grid lr_bs (a YAML grid can vary `size:` per trial instead)")
        if self.sizes == ["default"]:
            return
        if len(set(self.sizes)) < 2:
            raise UserError(
                "--sizes needs at least two different sizes: the joint fit is across model sizes; "
                "for one size drop --sizes"
            )
        shapes = [parse_size(size, self.model, self.head_dim) for size in self.sizes]
        lengths = [size_steps(size) for size in self.sizes]
        if any(lengths) and (None in lengths or len(set(shapes)) > 1 or len(self.batch_sizes or [4]) > 1):
            raise UserError(
                "--sizes WIDTHxDEPTH@STEPS scans training length: give one probe at several step counts (e.g. "
                "128x12@150 128x12@300 128x12@600) and one --batch_sizes; a scan varies the width or the length, "
                "not both"
            )
        if self.parametrization == "mup" and len({depth for _, depth in shapes}) > 1:
            raise UserError(
                "--parametrization mup transfers across width only: give --sizes of one depth (e.g. 64x2 128x2 256x2)"
            )

    @property
    def budget_spec(self) -> Budget:
        return BUDGETS[self.budget]

    def default_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-3 if self.model == "minimal" else 2e-5
