"""The inference commands' options and their input checks (merge, generate, bench).

They live apart from the code that runs them so that `merge_and_infer.py --help` and a bad flag answer before torch,
transformers and peft load (the same split as train/pretrain/config.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from llmlab.core.config import opt
from llmlab.core.errors import UserError
from llmlab.core.identity import BASE_RECORD, model_digest
from llmlab.core.runfolder import check_output_dir
from llmlab.data.instruct import PROMPT_FILE

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")


def _offline() -> bool:
    return any(
        os.environ.get(v, "0").lower() not in ("0", "", "false", "no")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def check_model_source(
    name: str,
    what: str = "--model",
    hint: str = "pass a folder written by save_pretrained, e.g. the --out of `merge_and_infer.py merge`",
    marker: str = "config.json",
) -> str:
    """A local folder must exist and hold `marker`; anything else is tried as a hub name unless offline."""
    path = Path(name).expanduser()
    if path.exists():
        if marker == "config.json" and (path / "adapter_config.json").is_file():
            raise UserError(f"{what} {name} is a LoRA adapter folder; pass it as --adapter with --base_model BASE")
        if not path.is_dir() or not (path / marker).is_file():
            raise UserError(
                f"{what} {name}: not {'an adapter' if 'adapter' in marker else 'a model'} folder (no {marker}); {hint}"
            )
        return str(path)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    if _offline() or looks_local:
        extra = "" if looks_local else " (or unset HF_HUB_OFFLINE to download a hub name)"
        raise UserError(f"{what} {name}: folder not found; {hint}{extra}")
    return name


def check_adapter_source(name: str) -> str:
    return check_model_source(
        name,
        "--adapter",
        "pass the folder train_lora.py saved the adapter to (adapter_config.json + adapter_model.safetensors)",
        marker="adapter_config.json",
    )


def quantization_config_of(model_dir: str) -> dict | None:
    """The quantization_config recorded in a local model folder's config.json (None if full precision)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("quantization_config")


def prompt_template(prompt_format: str, *folders: str | None) -> dict | None:
    """The instruction template saved with the adapter / merged model, per --prompt_format."""
    if prompt_format == "raw":
        return None
    for folder in folders:
        if folder and (Path(folder) / PROMPT_FILE).is_file():
            return json.loads((Path(folder) / PROMPT_FILE).read_text())
    if prompt_format == "template":
        raise UserError(
            f"--prompt_format template: no {PROMPT_FILE} in {' or '.join(f for f in folders if f)}; "
            "it is saved by train_lora.py next to the adapter (use --prompt_format raw otherwise)"
        )
    return None


DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.9


@dataclass
class ModelSourceConfig:
    """Either a merged/standalone model folder, or a base model + LoRA adapter used without merging."""

    model: Optional[str] = opt(None, "standalone model folder (e.g. the merge --out) or hub name")
    base_model: Optional[str] = opt(None, "base model folder/name, used with --adapter instead of --model")
    adapter: Optional[str] = opt(None, "LoRA adapter folder applied on top of --base_model, unmerged")
    tokenizer: Optional[str] = opt(None, "tokenizer name/path; unset = the one saved with the model or adapter")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto = CUDA when available, else CPU")
    threads: int = opt(
        0,
        "CPU threads for PyTorch (0 = PyTorch's default, one per core; on a busy machine "
        "fewer threads than cores can be much faster)",
    )

    def validate_source(self, model_with_adapter: bool = False) -> None:
        if not self.model and not self.base_model and not self.adapter:
            raise UserError("no model given: pass --model DIR (merged) or --base_model DIR --adapter DIR")
        if self.adapter and not self.base_model:
            raise UserError("--adapter needs --base_model (the full-precision model it was trained on)")
        if self.base_model and not self.adapter:
            raise UserError("--base_model needs --adapter (for a plain model use --model)")
        if self.model and self.base_model and not model_with_adapter:
            raise UserError("pass either --model (a merged model) or --base_model with --adapter, not both")
        if self.model:
            check_model_source(self.model, "--model")
        if self.base_model:
            check_model_source(self.base_model, "--base_model")
        if self.adapter:
            check_adapter_source(self.adapter)
        if self.threads < 0:
            raise UserError(f"--threads must be >= 0 (0 = PyTorch's default), got {self.threads}")


@dataclass
class GenerateConfig(ModelSourceConfig):
    prompt: Optional[str] = opt(None, "one prompt; its completion streams to the terminal")
    prompts_file: Optional[str] = opt(None, 'JSONL file, one {"prompt": ...} per line; completions go to --output')
    prompt_field: str = opt(
        "prompt",
        "field of each --prompts_file record holding the prompt (records may instead "
        "hold instruction/input fields when a prompt template applies)",
    )
    prompt_format: Literal["auto", "raw", "template"] = opt(
        "auto",
        f"auto = wrap prompts in the instruction template train_lora.py saved ({PROMPT_FILE} in the adapter "
        "or merged folder) when there is one, else feed them as is; raw = always as is; template = require it",
    )
    output: Optional[str] = opt(
        None,
        "JSONL results file; unset = <prompts_file>.generations.jsonl for "
        "--prompts_file, nothing (stream only) for --prompt",
    )
    precision: Literal["auto", "fp32", "fp16", "bf16", "int8", "int4"] = opt(
        "auto",
        "weights/compute precision: auto = fp16 on CUDA, fp32 on CPU; int8/int4 = bitsandbytes on CUDA; "
        "on CPU int8 = PyTorch dynamic INT8, int4 = bitsandbytes NF4 (CPU backend); fp16 needs CUDA",
    )
    max_new_tokens: int = opt(128, "tokens to generate per prompt")
    temperature: Optional[float] = opt(None, f"sampling temperature; unset = {DEFAULT_TEMPERATURE} (not with --greedy)")
    top_p: Optional[float] = opt(
        None,
        f"nucleus sampling: keep the smallest token set with this much probability; "
        f"unset = {DEFAULT_TOP_P}; 1 = off (not with --greedy)",
    )
    top_k: Optional[int] = opt(None, "keep only the k most likely tokens; unset = 0 = off (not with --greedy)")
    repetition_penalty: float = opt(1.1, "divide logits of already generated tokens by this (1 = off)")
    no_repeat_ngram_size: int = opt(3, "never repeat an n-gram of this size (0 = off)")
    greedy: bool = opt(False, "deterministic argmax decoding instead of sampling")
    seed: int = opt(0, "random seed for sampling (same seed + same flags = same text)")
    batch_size: int = opt(8, "prompts generated together in --prompts_file mode")

    def validate(self) -> None:
        if self.prompt is not None and self.prompts_file is not None:
            raise UserError("pass either --prompt or --prompts_file, not both")
        if self.prompt is None and self.prompts_file is None:
            raise UserError("nothing to generate: pass --prompt TEXT or --prompts_file FILE.jsonl")
        if self.greedy:
            given = [f"--{n}" for n in ("temperature", "top_p", "top_k") if getattr(self, n) is not None]
            if given:
                raise UserError(
                    f"--greedy ignores {', '.join(given)}; drop {'them' if len(given) > 1 else 'it'} "
                    "or drop --greedy to sample"
                )
        if self.temperature is not None and self.temperature <= 0:
            raise UserError(f"--temperature must be > 0 (use --greedy for argmax), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise UserError(f"--top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise UserError(f"--repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.no_repeat_ngram_size < 0:
            raise UserError(f"--no_repeat_ngram_size must be >= 0 (0 = off), got {self.no_repeat_ngram_size}")
        if self.output is not None and Path(self.output).is_dir():  # found before any model loads or text is generated
            raise UserError(f"--output {self.output} is a folder; pass a file path for the JSONL results")
        if self.output is not None:
            check_output_dir(Path(self.output).parent, "--output's folder")
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise UserError(
                f"--prompts_file {self.prompts_file} not found; pass a JSONL file with one "
                f'{{"{self.prompt_field}": ...}} per line'
            )
        self.validate_source()
        if self.prompt_format == "template":
            prompt_template("template", self.adapter, self.model)


@dataclass
class BenchConfig(ModelSourceConfig):
    precisions: list[str] = opt([], "precisions to compare; empty = every one this machine runs (fp32 first)")
    eval_data: str = opt(
        "builtin:wiki",
        "held-out text: a .txt file, or a corpus whose llmlab.data.prepare validation "
        "split is used (builtin:wiki = the offline Wikipedia sample)",
    )
    eval_tokens: int = opt(4096, "held-out tokens for perplexity")
    block_size: int = opt(256, "tokens per perplexity window and per prefill measurement")
    decode_tokens: int = opt(32, "new tokens per decode-speed measurement (greedy, batch 1)")
    repeats: int = opt(3, "timed repetitions per measurement (median reported), after one warm-up")
    output: Optional[str] = opt(None, "also write the results as JSON here")

    def validate(self) -> None:
        bad = [p for p in self.precisions if p not in PRECISIONS]
        if bad:
            raise UserError(f"--precisions: unknown {', '.join(bad)}; choose from {', '.join(PRECISIONS)}")
        for name in ("eval_tokens", "block_size", "repeats"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_tokens < 2:
            raise UserError(f"--decode_tokens must be >= 2, got {self.decode_tokens}")
        if self.eval_tokens < self.block_size:
            raise UserError(f"--eval_tokens {self.eval_tokens} is less than one --block_size {self.block_size}")
        if self.output is not None and Path(self.output).is_dir():
            raise UserError(f"--output {self.output} is a folder; pass a file path for the JSON results")
        self.validate_source(model_with_adapter=True)


@dataclass
class EvalConfig(ModelSourceConfig):
    tasks: list[str] = opt(
        ["builtin:pydoc-mc"],
        "lm-evaluation-harness tasks: names such as hellaswag (data from the hub), task YAML files, or "
        "builtin:pydoc-mc (offline multiple choice from the Python standard library)",
    )
    limit: Optional[int] = opt(None, "score only the first N items of each task (unset = all)")
    batch_size: int = opt(8, "sequences scored together")
    precision: Literal["auto", "fp32", "fp16", "bf16", "int8", "int4"] = opt(
        "auto", "weights/compute precision, as for generate: auto = fp16 on CUDA, fp32 on CPU"
    )
    work_dir: str = opt("runs/downstream", "folder for built task files (builtin:pydoc-mc's items and YAML)")
    output: Optional[str] = opt(None, "also write the scores as JSON here")

    def validate(self) -> None:
        if not self.tasks:
            raise UserError("--tasks is empty; name at least one task (e.g. builtin:pydoc-mc)")
        if (self.limit is not None and self.limit < 1) or self.batch_size < 1:
            raise UserError("--limit and --batch_size must be >= 1")
        if self.output is not None and Path(self.output).is_dir():
            raise UserError(f"--output {self.output} is a folder; pass a file path for the JSON scores")
        self.validate_source(model_with_adapter=False)


# fp32 merged vs unmerged differ only by summation order: 1e-3 of the logit scale is ~100x that rounding noise on
# the models we tested, yet far below what a wrong scale/transpose/missing layer produces (the adapter's own effect).
FP32_REL_TOLERANCE = 1e-3
# Casting to half precision rounds every weight: bf16 keeps 8 mantissa bits, fp16 11; these bounds only catch
# overflow and gross breakage, the printed difference is the real information.
CAST_REL_TOLERANCE = {"fp32": 0.0, "fp16": 2e-2, "bf16": 1e-1}


@dataclass
class MergeConfig:
    base_model: str = opt("", "full-precision base model folder (or hub name) the adapter was trained on")
    adapter: str = opt("", "LoRA adapter folder written by train_lora.py (adapter_config.json + weights)")
    out: str = opt("", "output folder for the merged standalone model (written to a temp dir, then renamed)")
    dtype: Literal["fp16", "bf16", "fp32"] = opt("fp16", "dtype of the saved weights; verification always runs in fp32")
    tolerance: Optional[float] = opt(
        None,
        f"max allowed |merged - unmerged| logit difference in fp32; unset = {FP32_REL_TOLERANCE} x max(1, max |logit|)",
    )
    overwrite: bool = opt(False, "replace --out if it already exists")
    tokenizer: Optional[str] = opt(None, "tokenizer to save alongside; unset = the adapter's, else the base's")
    device: Literal["cpu", "cuda"] = opt("cpu", "where to merge and verify (fp32 needs 4 bytes per parameter)")

    def validate(self) -> tuple[str, str, Path]:
        for name in ("base_model", "adapter", "out"):
            if not getattr(self, name):
                raise UserError(f"merge needs --{name}; see merge_and_infer.py merge --help")
        if self.tolerance is not None and self.tolerance <= 0:
            raise UserError(f"--tolerance must be > 0, got {self.tolerance}")
        return self.check_paths()

    def check_paths(self) -> tuple[str, str, Path]:
        """Cheap checks before any model is loaded: folders exist, --out is new, the base is not quantized."""
        base = check_model_source(self.base_model, "--base_model")
        adapter = check_adapter_source(self.adapter)
        out = Path(self.out).expanduser()
        for name, source in (("--base_model", base), ("--adapter", adapter)):
            inside = Path(source).exists() and (
                out.resolve() == Path(source).resolve() or out.resolve() in Path(source).resolve().parents
            )
            if inside:
                raise UserError(
                    f"--out {self.out} is or contains the {name} folder; pick a new folder for the merged model"
                )
        if out.exists() and not self.overwrite:
            raise UserError(f"--out {self.out} already exists; pass --overwrite to replace it or choose another folder")
        if out.exists() and not (out / "merge_report.json").is_file():  # never delete what merge did not write
            raise UserError(
                f"--out {self.out} exists and is not a merged model written by this command (no "
                "merge_report.json); --overwrite only replaces an earlier merge: choose another folder"
            )
        check_same_base(adapter, base, self.base_model)
        quant = quantization_config_of(base) if Path(base).is_dir() else None
        if quant:
            raise UserError(
                f"--base_model {self.base_model} is quantized ({quant.get('quant_method', 'quantized')}); "
                "merging into quantized weights loses the adapter's precision: merge into the "
                "full-precision base, then quantize at load time (generate --precision int8/int4)"
            )
        return base, adapter, out


def check_same_base(adapter: str, base: str, given: str) -> None:
    """The adapter records the base it was trained on (train_lora.py); merging it into another base of the same
    shape would succeed and be wrong. Adapters trained elsewhere carry no record and cannot be checked."""
    record = Path(adapter) / BASE_RECORD
    if not record.is_file():
        return
    try:
        trained_on = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    if trained_on.get("digest") and trained_on["digest"] != model_digest(base):
        raise UserError(
            f"--adapter {adapter} was trained on {trained_on.get('base_model')} "
            f"({trained_on['digest']}), and --base_model {given} has other weights "
            f"({model_digest(base)}); pass the base it was trained on"
        )
