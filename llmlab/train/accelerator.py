"""The Accelerator a run trains with: mixed precision, gradient accumulation, trackers, and one data-parallel run
across CPU processes (gloo) or GPUs; a launch that would train several separate models is refused."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

from llmlab.core.device import resolve_device, resolve_precision
from llmlab.core.errors import UserError
from llmlab.core.tracking import make_trackers


def distributed_cpu() -> bool:
    """Several processes (accelerate launch, torchrun, deepspeed) and no GPU."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def process_group_handlers() -> list:
    """accelerate kwargs_handlers for this launch: gloo when several processes share no GPU.

    Without it accelerate silently runs each CPU rank as "process 0 of 1" on the same data; a single plain
    `python` process must not ask for a process group at all.
    """
    return [InitProcessGroupKwargs(backend="gloo")] if distributed_cpu() else []


def accelerator_placement() -> dict:
    """Accelerator kwargs that make several CPU processes one data-parallel run. Without `cpu=True` accelerate keeps
    distributed_type NO under `--multi_gpu` or torchrun on a CPU machine: prepare() skips DDP, gradients are never
    averaged, and each process trains its own model. DeepSpeed brings its own CPU backend and must not get it."""
    return {"cpu": True} if distributed_cpu() and not deepspeed_launch() else {}


def deepspeed_launch() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def skip_unused_shared_memory_allreduce() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory allreduce when its process group starts: about a minute
    of C++ on 2 cores, the first time in every fresh extensions folder. Only its tensor-parallel inference calls
    that op; ZeRO training reduces through torch.distributed (gloo), at any number of processes. Marked unavailable,
    it is neither built nor loaded."""
    if not deepspeed_launch() or torch.cuda.is_available():
        return
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def resolve_mixed_precision(choice: str) -> str:
    """`auto` under `accelerate launch`: the launch's own precision (its config file or flag; accelerate's default is
    "no", fp32), so a config that says fp32 runs fp32. Under a DeepSpeed launch (whose JSON says "auto") and a plain
    `python` run: the same hardware choice as the sweep's trials (core.device.resolve_precision), in accelerate's
    spelling ("no" for fp32)."""

    if choice != "auto":
        return choice
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launched in ("no", "bf16", "fp16") and not (deepspeed_launch() and launched == "no"):
        return launched
    chosen = resolve_precision("auto", resolve_device("auto"))
    return "no" if chosen == "fp32" else chosen


def check_one_model(accelerator) -> None:
    """Never several processes training separate models: a launch of N processes that accelerate did not make one
    distributed run is refused before any work."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > accelerator.num_processes:
        raise UserError(
            f"{launched} processes were launched but accelerate set up {accelerator.distributed_type.value}"
            f" with {accelerator.num_processes}: each would train its own model; launch with `accelerate "
            "launch --multi_gpu --num_processes N` or torchrun"
        )
    # accelerate's simple launcher (`--cpu` with several processes or machines) sets MASTER_ADDR and leaves the ranks
    # to mpirun; without MPI every machine would train a model of its own
    simple_launch = "ACCELERATE_USE_CPU" in os.environ and "MASTER_ADDR" in os.environ
    mpi = any(name in os.environ for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"))
    if accelerator.num_processes == 1 and simple_launch and "WORLD_SIZE" not in os.environ and not mpi:
        raise UserError(
            "accelerate launch was asked for several processes or machines but started this one alone "
            "(its --cpu launcher leaves the ranks to mpirun), so each would train its own model; on CPUs "
            "launch with --multi_gpu instead of --cpu (it runs gloo across the machines)"
        )


def make_accelerator(cfg, mixed_precision, plugin, accumulation_steps: int, out: Path):

    trackers = make_trackers(cfg.report_to, out)  # an unknown or missing tracker fails before anything starts
    kwargs = (
        {"gradient_accumulation_plugin": plugin}
        if plugin is not None
        else {"gradient_accumulation_steps": accumulation_steps}
    )
    skip_unused_shared_memory_allreduce()
    try:
        accelerator = Accelerator(
            mixed_precision=mixed_precision,
            kwargs_handlers=process_group_handlers(),
            log_with=trackers,
            project_dir=str(out),
            dataloader_config=DataLoaderConfiguration(non_blocking=True),  # overlaps a pinned batch's copy (GPU)
            **accelerator_placement(),
            **kwargs,
        )
    except ValueError as err:
        raise UserError(
            f"accelerate cannot set up this run ({str(err).splitlines()[0][:200]}); "
            "check --mixed_precision and the `accelerate launch` config"
        ) from None
    check_one_model(accelerator)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError(
            "--mixed_precision fp16 needs a GPU (on CPU there is no fp16 loss scaling); "
            "use --mixed_precision bf16 or no"
        )
    return accelerator
