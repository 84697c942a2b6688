"""Side-by-side inference benchmark: every precision this machine runs, same prompts, same held-out text.

Per precision: serialized weight size, weight bytes in memory, load time, prefill and decode tokens/s, peak memory
and held-out perplexity (with its change vs fp32). With an adapter, also base+adapter unmerged vs merged speed.
Decode speed is isolated as (generate N tokens - generate 1 token) / (N - 1), so prompt processing is not counted.
"""

from __future__ import annotations

import ctypes
import gc
import io
import os
import statistics
import tempfile
import threading
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmlab.core.device import resolve_device
from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_json
from llmlab.core.runinfo import hardware_info, package_versions
from llmlab.infer.config import PRECISIONS, BenchConfig, MergeConfig
from llmlab.infer.generate import apply_threads, heldout_perplexity, heldout_token_blocks
from llmlab.infer.loading import load_for_inference, load_tokenizer_for, quiet_backend_logs
from llmlab.infer.merge import merge_adapter
from llmlab.infer.quantize import available_precisions, check_precision
from llmlab.models.gpt2 import context_length_of

BENCH_PROMPT = "The history of the city begins in the early middle ages, when"


class PeakMemory:
    """Peak process RSS (CPU, sampled every 2 ms) or peak CUDA allocation during a `with` block, in MB above
    its start."""

    def __init__(self, device: str):
        self.device, self.peak_mb = device, 0.0

    def __enter__(self):
        gc.collect()
        _malloc_trim()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
            return self
        self._start, self._peak, self._stop = _rss_bytes(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.device == "cuda":
            self.peak_mb = (torch.cuda.max_memory_allocated() - self._start) / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = (max(self._peak, _rss_bytes()) - self._start) / 2**20


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _malloc_trim() -> None:
    """Hand freed heap back to the OS so the next precision's RSS peak is not hidden by reused pages."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of all weight tensors as stored in memory, bytes of the serialized state_dict)."""
    seen, in_memory = set(), 0

    def visit(value):
        nonlocal in_memory
        if isinstance(value, torch.Tensor):
            if value.is_quantized:
                in_memory += value.int_repr().numel() * value.element_size()
            elif value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                in_memory += value.numel() * value.element_size()
        elif isinstance(value, (tuple, list)):
            for item in value:
                visit(item)

    state = model.state_dict()
    for value in state.values():
        visit(value)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return in_memory, buffer.getbuffer().nbytes


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: kernels, caches, lazy inits
    return statistics.median(_seconds(fn) for _ in range(repeats))


def speed(model, tokenizer, blocks, cfg: BenchConfig) -> dict:
    device = next(model.parameters()).device
    prefill_ids = torch.tensor(blocks[:1], device=device)
    prompt = tokenizer(BENCH_PROMPT, return_tensors="pt")["input_ids"].to(device)
    eos = tokenizer.eos_token_id

    def forward():
        with torch.inference_mode():
            model(input_ids=prefill_ids)

    def gen(n):
        def run():
            with torch.inference_mode():
                model.generate(
                    input_ids=prompt,
                    attention_mask=torch.ones_like(prompt),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=eos,
                    eos_token_id=eos,
                )

        return run

    prefill_s = _median_seconds(forward, cfg.repeats)
    gen(1)()  # warm-up
    gen(cfg.decode_tokens)()
    decode_s = []
    for _ in range(cfg.repeats):  # paired: each repeat's N-token minus 1-token run, so drifting load cancels more
        decode_s.append(-_seconds(gen(1)) + _seconds(gen(cfg.decode_tokens)))
    return {
        "prefill_tok_s": prefill_ids.numel() / prefill_s,
        "decode_tok_s": (cfg.decode_tokens - 1) / max(statistics.median(decode_s), 1e-9),
    }


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_one(
    name: str,
    precision: str,
    device: str,
    blocks,
    cfg: BenchConfig,
    *,
    model: str | None,
    base_model: str | None = None,
    adapter: str | None = None,
    merge: bool = False,
) -> dict:
    with PeakMemory(device) as peak:  # what running the model costs: load + batch-1 prefill and decode
        start = time.perf_counter()
        loaded = load_for_inference(
            model=model,
            base_model=base_model,
            adapter=adapter,
            precision=precision,
            device=device,
            tokenizer=cfg.tokenizer,
            merge_adapter=merge,
        )
        load_s = time.perf_counter() - start
        row = {
            "name": name,
            "precision": loaded.precision,
            "load_s": load_s,
            "quantized_layers": loaded.quantized_layers,
        }
        row.update(speed(loaded.model, loaded.tokenizer, blocks, cfg))
    row["peak_mb"] = peak.peak_mb
    row["perplexity"] = heldout_perplexity(loaded.model, blocks, batch_size=1)
    in_memory, serialized = weight_bytes(loaded.model)
    row.update(weights_mb=in_memory / 2**20, disk_mb=serialized / 2**20)
    del loaded
    gc.collect()
    return row


def warm_up_imports(model_dir: str) -> None:
    """Import the model's code once (on the meta device: no memory) so the first row's load time is not inflated."""
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def run_bench(cfg: BenchConfig, log=print) -> dict:
    # long: 75 lines once ruff's layout puts its long calls one argument a line; one step, read top to bottom
    quiet_backend_logs()
    apply_threads(cfg.threads)
    device = resolve_device(cfg.device)
    precisions = cfg.precisions or available_precisions(device)
    for p in precisions:
        check_precision(p, device)
    precisions = sorted(set(precisions), key=PRECISIONS.index)
    tokenizer = load_tokenizer_for(cfg.adapter, cfg.model or cfg.base_model, name=cfg.tokenizer)
    context = context_length_of(cfg.model or cfg.base_model)
    if context and cfg.block_size > context:
        raise UserError(
            f"--block_size {cfg.block_size} exceeds the model's {context}-token context; "
            f"pass --block_size {context} or less"
        )
    blocks = heldout_token_blocks(cfg.eval_data, tokenizer, cfg.block_size, cfg.eval_tokens)
    log(
        f"held-out text: {len(blocks)} x {cfg.block_size} tokens from {cfg.eval_data}; device {device}; "
        f"precisions {', '.join(precisions)}"
    )

    with tempfile.TemporaryDirectory(prefix="llmlab-bench-") as tmp:
        model_dir = cfg.model
        if model_dir is None:  # base + adapter: bench the merged model at every precision, merged once here
            model_dir = os.path.join(tmp, "merged")
            merge_adapter(
                MergeConfig(
                    base_model=cfg.base_model, adapter=cfg.adapter, out=model_dir, dtype="fp32", tokenizer=cfg.tokenizer
                ),
                log=lambda msg: None,
            )
        warm_up_imports(model_dir)
        rows = []
        for precision in precisions:
            log(f"  {precision} ...")
            rows.append(bench_one(precision, precision, device, blocks, cfg, model=model_dir))
        adapter_rows = []
        if cfg.adapter:
            reference = "fp32" if device == "cpu" else "fp16"
            for name, merge in ((f"{reference} base+adapter (unmerged)", False), (f"{reference} merged", True)):
                log(f"  {name} ...")
                adapter_rows.append(
                    bench_one(
                        name,
                        reference,
                        device,
                        blocks,
                        cfg,
                        model=None,
                        base_model=cfg.base_model,
                        adapter=cfg.adapter,
                        merge=merge,
                    )
                )
    fp32 = next((r for r in rows if r["precision"] == "fp32"), rows[0] if rows else None)
    for row in rows + adapter_rows:
        row["ppl_change_pct"] = 100 * (row["perplexity"] / fp32["perplexity"] - 1) if fp32 else None
        row["decode_vs_fp32"] = row["decode_tok_s"] / fp32["decode_tok_s"] if fp32 else None
    result = {
        "device": device,
        "threads": torch.get_num_threads(),
        "hardware": hardware_info(),
        "versions": package_versions(),
        "eval_data": cfg.eval_data,
        "eval_tokens": len(blocks) * cfg.block_size,
        "block_size": cfg.block_size,
        "decode_tokens": cfg.decode_tokens,
        "rows": rows,
        "adapter_rows": adapter_rows,
    }
    log(format_table(result))
    if cfg.output:
        atomic_write_json(cfg.output, result)
        log(f"wrote {cfg.output}")
    return result


def format_table(result: dict) -> str:
    headers = (
        "precision",
        "disk MB",
        "weights MB",
        "load s",
        "prefill tok/s",
        "decode tok/s",
        "decode x",
        "peak MB",
        "perplexity",
        "ppl vs fp32",
    )
    lines = []
    for row in result["rows"] + result["adapter_rows"]:
        lines.append(
            (
                row["name"],
                f"{row['disk_mb']:.1f}",
                f"{row['weights_mb']:.1f}",
                f"{row['load_s']:.2f}",
                f"{row['prefill_tok_s']:.0f}",
                f"{row['decode_tok_s']:.1f}",
                f"{row['decode_vs_fp32']:.2f}",
                f"{row['peak_mb']:.0f}",
                f"{row['perplexity']:.3f}",
                f"{row['ppl_change_pct']:+.2f}%",
            )
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    fmt = lambda cells: " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [
        f"inference benchmark on {result['device']} ({result['threads']} threads): "
        f"{result['eval_tokens']} held-out tokens "
        f"({result['eval_data']}), prefill {result['block_size']} tokens, decode {result['decode_tokens']} tokens",
        fmt(headers),
        "-+-".join("-" * w for w in widths),
    ]
    out += [fmt(line) for line in lines]
    out.append(
        "disk MB = serialized state_dict at that precision; weights MB = weight tensors in memory; peak MB = "
        "peak memory above the pre-load level (RSS on CPU, CUDA allocations on GPU); decode x = decode "
        "speed / fp32's"
    )
    return "\n".join(out)
