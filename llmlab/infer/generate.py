"""Text generation with sampling controls (streamed or batched to JSONL) and held-out perplexity."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from llmlab.core.config import opt
from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_text
from llmlab.data.instruct import PROMPT_FILE

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
    threads: int = opt(0, "CPU threads for PyTorch (0 = PyTorch's default, one per core; on a busy machine "
                          "fewer threads than cores can be much faster)")

    def validate_source(self, model_with_adapter: bool = False) -> None:
        from llmlab.infer.loading import check_adapter_source, check_model_source

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

    def apply_threads(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)


@dataclass
class GenerateConfig(ModelSourceConfig):
    prompt: Optional[str] = opt(None, "one prompt; its completion streams to the terminal")
    prompts_file: Optional[str] = opt(None, "JSONL file, one {\"prompt\": ...} per line; completions go to --output")
    prompt_field: str = opt("prompt", "field of each --prompts_file record holding the prompt (records may instead "
                                      "hold instruction/input fields when a prompt template applies)")
    prompt_format: Literal["auto", "raw", "template"] = opt(
        "auto", f"auto = wrap prompts in the instruction template train_lora.py saved ({PROMPT_FILE} in the adapter "
                "or merged folder) when there is one, else feed them as is; raw = always as is; template = require it")
    output: Optional[str] = opt(None, "JSONL results file; unset = <prompts_file>.generations.jsonl for "
                                      "--prompts_file, nothing (stream only) for --prompt")
    precision: Literal["auto", "fp32", "fp16", "bf16", "int8", "int4"] = opt(
        "auto", "weights/compute precision: auto = fp16 on CUDA, fp32 on CPU; int8/int4 = bitsandbytes on CUDA; "
                "on CPU int8 = PyTorch dynamic INT8, int4 = bitsandbytes NF4 (CPU backend); fp16 needs CUDA")
    max_new_tokens: int = opt(128, "tokens to generate per prompt")
    temperature: Optional[float] = opt(None, f"sampling temperature; unset = {DEFAULT_TEMPERATURE} (not with --greedy)")
    top_p: Optional[float] = opt(None, f"nucleus sampling: keep the smallest token set with this much probability; "
                                       f"unset = {DEFAULT_TOP_P}; 1 = off (not with --greedy)")
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
                raise UserError(f"--greedy ignores {', '.join(given)}; drop {'them' if len(given) > 1 else 'it'} "
                                "or drop --greedy to sample")
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
            from llmlab.core.runfolder import check_output_dir

            check_output_dir(Path(self.output).parent, "--output's folder")
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise UserError(f"--prompts_file {self.prompts_file} not found; pass a JSONL file with one "
                            f"{{\"{self.prompt_field}\": ...}} per line")
        self.validate_source()
        if self.prompt_format == "template":
            prompt_template("template", self.adapter, self.model)


def generation_config(cfg: GenerateConfig, tokenizer):
    """A complete GenerationConfig, so nothing falls back to a model's saved defaults (e.g. GPT-2's top_k=50)."""
    from transformers import GenerationConfig

    common = dict(max_new_tokens=cfg.max_new_tokens, repetition_penalty=cfg.repetition_penalty,
                  no_repeat_ngram_size=cfg.no_repeat_ngram_size, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    if cfg.greedy:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(
        do_sample=True, temperature=cfg.temperature if cfg.temperature is not None else DEFAULT_TEMPERATURE,
        top_p=cfg.top_p if cfg.top_p is not None else DEFAULT_TOP_P, top_k=cfg.top_k or 0, **common)


def read_prompts(path: str, field: str) -> list[dict]:
    from llmlab.core.io import utf8_lines

    records = []
    for number, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path} line {number} is not valid JSON; each line must be {{\"{field}\": ...}}") from None
        if not isinstance(record, dict) or not any(isinstance(record.get(k), str) for k in (field, "instruction")):
            raise UserError(f"{path} line {number} has no string field {field!r} (or 'instruction'); "
                            "set --prompt_field or fix the file")
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no prompts")
    return records


def prompt_template(prompt_format: str, *folders: str | None) -> dict | None:
    """The instruction template saved with the adapter / merged model, per --prompt_format."""
    if prompt_format == "raw":
        return None
    for folder in folders:
        if folder and (Path(folder) / PROMPT_FILE).is_file():
            return json.loads((Path(folder) / PROMPT_FILE).read_text())
    if prompt_format == "template":
        raise UserError(f"--prompt_format template: no {PROMPT_FILE} in {' or '.join(f for f in folders if f)}; "
                        "it is saved by train_lora.py next to the adapter (use --prompt_format raw otherwise)")
    return None


def model_inputs(records: list[dict], field: str, template: dict | None) -> list[str]:
    """The text each record feeds the model: as is, or formatted the way train_lora.py trained the adapter."""
    if template is None:
        return [r[field] if isinstance(r.get(field), str) else r["instruction"] for r in records]
    from llmlab.data.instruct import format_prompt

    inputs = []
    for r in records:
        fields = {"instruction": r["instruction"], "input": r.get("input") or ""} if isinstance(
            r.get("instruction"), str) else {"instruction": r[field]}
        inputs.append(format_prompt(fields, template["prompt_template"], template["prompt_template_no_input"]))
    return inputs


def _max_prompt_tokens(model, max_new_tokens: int) -> int:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None:
        return 10**9
    if max_new_tokens >= limit:
        raise UserError(f"--max_new_tokens {max_new_tokens} does not fit the model's {limit}-token context")
    return limit - max_new_tokens


def generate(model, tokenizer, prompts: list[str], gen_config, seed: int, batch_size: int = 8,
             streamer=None, progress: bool = False) -> list[dict]:
    """Completions for `prompts` (left-padded batches); truncates over-long prompts from the left."""
    import torch
    from tqdm.auto import tqdm
    from transformers import set_seed

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    max_prompt = _max_prompt_tokens(model, gen_config.max_new_tokens)
    long = [i for i, p in enumerate(prompts) if len(tokenizer(p)["input_ids"]) > max_prompt]
    if long:  # said, not silent: the model sees only the end of these prompts
        print(f"note: {len(long)} prompt(s) (#{', #'.join(str(i + 1) for i in long[:5])}{', ...' if len(long) > 5 else ''}) "
              f"exceed the {max_prompt} tokens the context leaves after --max_new_tokens; only their last {max_prompt} "
              "tokens are used", flush=True)
    device = next(model.parameters()).device
    set_seed(seed)
    results = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="generate", unit="batch", disable=not progress):
        chunk = prompts[start:start + batch_size]
        batch = tokenizer(chunk, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt)
        with torch.inference_mode():
            out = model.generate(**{k: v.to(device) for k, v in batch.items()}, generation_config=gen_config,
                                 streamer=streamer)
        new = out[:, batch["input_ids"].shape[1]:].cpu()
        for prompt, ids in zip(chunk, new):
            ids = _until_eos(ids.tolist(), gen_config.eos_token_id)  # after eos come only pads
            results.append({"prompt": prompt, "completion": tokenizer.decode(ids, skip_special_tokens=True),
                            "new_tokens": len(ids)})
    return results


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def run_generate(cfg: GenerateConfig, log=print) -> list[dict]:
    from transformers import TextStreamer

    from llmlab.infer.loading import load_for_inference

    cfg.apply_threads()
    loaded = load_for_inference(model=cfg.model, base_model=cfg.base_model, adapter=cfg.adapter,
                                precision=cfg.precision, device=cfg.device, tokenizer=cfg.tokenizer)
    for note in loaded.notes:
        log(f"note: {note}")
    gen_config = generation_config(cfg, loaded.tokenizer)
    settings = {"precision": loaded.precision, "seed": cfg.seed, **{k: getattr(gen_config, k) for k in (
        "do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "no_repeat_ngram_size", "max_new_tokens")}}
    if not gen_config.do_sample:
        settings.update(temperature=None, top_p=None, top_k=None)
    template = prompt_template(cfg.prompt_format, cfg.adapter, cfg.model)
    if cfg.prompt is not None:
        inputs = [{"prompt": cfg.prompt}]
        texts = model_inputs(inputs, "prompt", template)
        print(texts[0], end="", flush=True)
        streamer = TextStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
        done = generate(loaded.model, loaded.tokenizer, texts, gen_config, cfg.seed, 1, streamer)
        output = cfg.output
    else:
        inputs = read_prompts(cfg.prompts_file, cfg.prompt_field)
        texts = model_inputs(inputs, cfg.prompt_field, template)
        done = generate(loaded.model, loaded.tokenizer, texts, gen_config, cfg.seed, cfg.batch_size, progress=True)
        output = cfg.output or str(Path(cfg.prompts_file).with_suffix("")) + ".generations.jsonl"
    records = [{**source, **({"model_input": r["prompt"]} if template else {}),
                **{k: v for k, v in r.items() if k != "prompt"}, **settings} for source, r in zip(inputs, done)]
    if output:
        save_generations(output, records, log)
    return records


def save_generations(output: str, records: list[dict], log=print) -> None:
    """The results as JSONL; when the disk refuses them, they go to stdout instead (generated text is never lost)
    and the one-line error says so."""
    from llmlab.core.errors import UserError, write_failure

    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    try:
        atomic_write_text(output, text)
    except OSError as err:
        if write_failure(err) is None:
            raise
        print(text, end="", flush=True)
        raise UserError(f"could not write {output}: {write_failure(err)}; the {len(records)} generation(s) were "
                        "printed above as JSONL instead") from None
    log(f"wrote {len(records)} generation(s) to {output}")


# ---- perplexity on held-out text ---------------------------------------------------------------------------------

def heldout_token_blocks(source: str, tokenizer, block_size: int, max_tokens: int) -> list[list[int]]:
    """Blocks of `block_size` token ids: a text file's whole content, or the validation split that llmlab.data.prepare
    holds out of a corpus (builtin:wiki by default), so models trained by this repo never saw it."""
    path = Path(source).expanduser()
    n_blocks = max(1, max_tokens // block_size)
    if path.is_file() and path.suffix in (".txt", ".md", ""):
        ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        blocks = [ids[i:i + block_size] for i in range(0, len(ids) - block_size + 1, block_size)]
        if not blocks:
            raise UserError(f"--eval_data {source} has {len(ids)} tokens; it needs at least --block_size {block_size}")
        return blocks[:n_blocks]
    from llmlab.data.prepare import DataConfig, prepare_dataset

    prepared = prepare_dataset(DataConfig(dataset=source, block_size=block_size), tokenizer)
    validation = prepared.validation
    if len(validation) == 0:
        raise UserError(f"--eval_data {source} has no validation split at block size {block_size}")
    return [list(row) for row in validation.select(range(min(n_blocks, len(validation))))["input_ids"]]


def heldout_perplexity(model, blocks: list[list[int]], batch_size: int = 4) -> float:
    """exp(mean next-token NLL) over the blocks (every token but each block's first is predicted)."""
    import torch

    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(blocks), batch_size):
            ids = torch.tensor(blocks[start:start + batch_size], device=device)
            logits = model(input_ids=ids).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                    ids[:, 1:].reshape(-1), reduction="sum")
            total_nll += float(nll)
            total_tokens += ids[:, 1:].numel()
    return math.exp(total_nll / total_tokens)
