"""Text generation with sampling controls (streamed or batched to JSONL) and held-out perplexity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, TextStreamer, set_seed

from llmlab.core.errors import UserError, write_failure
from llmlab.core.io import atomic_write_text, utf8_lines
from llmlab.data.instruct import format_prompt
from llmlab.data.prepare import DataConfig, prepare_dataset
from llmlab.infer.config import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, GenerateConfig, prompt_template
from llmlab.infer.loading import load_from_config


def apply_threads(threads: int) -> None:
    if threads:
        torch.set_num_threads(threads)


def generation_config(cfg: GenerateConfig, tokenizer):
    """A complete GenerationConfig, so nothing falls back to a model's saved defaults (e.g. GPT-2's top_k=50)."""
    common = dict(
        max_new_tokens=cfg.max_new_tokens,
        repetition_penalty=cfg.repetition_penalty,
        no_repeat_ngram_size=cfg.no_repeat_ngram_size,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    if cfg.greedy:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(
        do_sample=True,
        temperature=cfg.temperature if cfg.temperature is not None else DEFAULT_TEMPERATURE,
        top_p=cfg.top_p if cfg.top_p is not None else DEFAULT_TOP_P,
        top_k=cfg.top_k or 0,
        **common,
    )


def read_prompts(path: str, field: str) -> list[dict]:
    records = []
    for number, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f'{path} line {number} is not valid JSON; each line must be {{"{field}": ...}}') from None
        if not isinstance(record, dict) or not any(isinstance(record.get(k), str) for k in (field, "instruction")):
            raise UserError(
                f"{path} line {number} has no string field {field!r} (or 'instruction'); "
                "set --prompt_field or fix the file"
            )
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no prompts")
    return records


def model_inputs(records: list[dict], field: str, template: dict | None) -> list[str]:
    """The text each record feeds the model: as is, or formatted the way train_lora.py trained the adapter."""
    if template is None:
        return [r[field] if isinstance(r.get(field), str) else r["instruction"] for r in records]
    inputs = []
    for r in records:
        fields = (
            {"instruction": r["instruction"], "input": r.get("input") or ""}
            if isinstance(r.get("instruction"), str)
            else {"instruction": r[field]}
        )
        inputs.append(format_prompt(fields, template["prompt_template"], template["prompt_template_no_input"]))
    return inputs


def _max_prompt_tokens(model, max_new_tokens: int) -> int:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None:
        return 10**9
    if max_new_tokens >= limit:
        raise UserError(f"--max_new_tokens {max_new_tokens} does not fit the model's {limit}-token context")
    return limit - max_new_tokens


def generate(
    model,
    tokenizer,
    prompts: list[str],
    gen_config,
    seed: int,
    batch_size: int = 8,
    streamer=None,
    progress: bool = False,
) -> list[dict]:
    """Completions for `prompts` (left-padded batches); truncates over-long prompts from the left."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    max_prompt = _max_prompt_tokens(model, gen_config.max_new_tokens)
    long = [i for i, p in enumerate(prompts) if len(tokenizer(p)["input_ids"]) > max_prompt]
    if long:  # said, not silent: the model sees only the end of these prompts
        print(
            f"note: {len(long)} prompt(s) "
            f"(#{', #'.join(str(i + 1) for i in long[:5])}{', ...' if len(long) > 5 else ''}) "
            f"exceed the {max_prompt} tokens the context leaves after --max_new_tokens; only their last {max_prompt} "
            "tokens are used",
            flush=True,
        )
    device = next(model.parameters()).device
    set_seed(seed)
    results = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="generate", unit="batch", disable=not progress):
        chunk = prompts[start : start + batch_size]
        batch = tokenizer(chunk, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt)
        with torch.inference_mode():
            out = model.generate(
                **{k: v.to(device) for k, v in batch.items()}, generation_config=gen_config, streamer=streamer
            )
        new = out[:, batch["input_ids"].shape[1] :].cpu()
        for prompt, ids in zip(chunk, new):
            ids = _until_eos(ids.tolist(), gen_config.eos_token_id)  # after eos come only pads
            results.append(
                {
                    "prompt": prompt,
                    "completion": tokenizer.decode(ids, skip_special_tokens=True),
                    "new_tokens": len(ids),
                }
            )
    return results


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def run_generate(cfg: GenerateConfig, log=print) -> list[dict]:
    loaded = load_from_config(cfg, log)
    gen_config = generation_config(cfg, loaded.tokenizer)
    settings = {
        "precision": loaded.precision,
        "seed": cfg.seed,
        **{
            k: getattr(gen_config, k)
            for k in (
                "do_sample",
                "temperature",
                "top_p",
                "top_k",
                "repetition_penalty",
                "no_repeat_ngram_size",
                "max_new_tokens",
            )
        },
    }
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
    records = [
        {
            **source,
            **({"model_input": r["prompt"]} if template else {}),
            **{k: v for k, v in r.items() if k != "prompt"},
            **settings,
        }
        for source, r in zip(inputs, done)
    ]
    if output:
        save_generations(output, records, log)
    return records


def save_generations(output: str, records: list[dict], log=print) -> None:
    """The results as JSONL; when the disk refuses them, they go to stdout instead (generated text is never lost)
    and the one-line error says so."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    try:
        atomic_write_text(output, text)
    except OSError as err:
        if write_failure(err) is None:
            raise
        print(text, end="", flush=True)
        raise UserError(
            f"could not write {output}: {write_failure(err)}; the {len(records)} generation(s) were "
            "printed above as JSONL instead"
        ) from None
    log(f"wrote {len(records)} generation(s) to {output}")


# ---- perplexity on held-out text ---------------------------------------------------------------------------------


def heldout_token_blocks(source: str, tokenizer, block_size: int, max_tokens: int) -> list[list[int]]:
    """Blocks of `block_size` token ids: a text file's whole content, or the validation split that llmlab.data.prepare
    holds out of a corpus (builtin:wiki by default), so models trained by this repo never saw it."""
    path = Path(source).expanduser()
    n_blocks = max(1, max_tokens // block_size)
    if path.is_file() and path.suffix in (".txt", ".md", ""):
        ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        blocks = [ids[i : i + block_size] for i in range(0, len(ids) - block_size + 1, block_size)]
        if not blocks:
            raise UserError(f"--eval_data {source} has {len(ids)} tokens; it needs at least --block_size {block_size}")
        return blocks[:n_blocks]
    prepared = prepare_dataset(DataConfig(dataset=source, block_size=block_size), tokenizer)
    validation = prepared.validation
    if len(validation) == 0:
        raise UserError(f"--eval_data {source} has no validation split at block size {block_size}")
    n = min(n_blocks, len(validation))
    return validation.window(0, n * block_size).reshape(n, block_size).tolist()


def heldout_perplexity(model, blocks: list[list[int]], batch_size: int = 4) -> float:
    """exp(mean next-token NLL) over the blocks (every token but each block's first is predicted)."""
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(blocks), batch_size):
            ids = torch.tensor(blocks[start : start + batch_size], device=device)
            logits = model(input_ids=ids).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            )
            total_nll += float(nll)
            total_tokens += ids[:, 1:].numel()
    return math.exp(total_nll / total_tokens)
