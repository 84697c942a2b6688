#!/usr/bin/env python
"""Merge a LoRA adapter into its base, generate text at a chosen precision, and benchmark precisions side by side.

python merge_and_infer.py merge    --base_model BASE --adapter ADAPTER --out merged [--dtype fp16]
python merge_and_infer.py generate --model merged --prompt "Once upon a time" [--precision int8]
python merge_and_infer.py generate --base_model BASE --adapter ADAPTER --prompts_file prompts.jsonl
python merge_and_infer.py bench    --model merged [--base_model BASE --adapter ADAPTER]
python merge_and_infer.py eval     --model merged --tasks builtin:pydoc-mc hellaswag [--limit 500]
"""

from __future__ import annotations

import argparse
import importlib
import sys

from llmlab.core.config import Parser, add_dataclass_args, config_from_namespace
from llmlab.core.errors import cli_entry
from llmlab.infer.config import BenchConfig, EvalConfig, GenerateConfig, MergeConfig

HELP = {
    "merge": "merge a LoRA adapter into its base, verify the logits, save a standalone safetensors model + tokenizer",
    "generate": "generate from a merged model or base + adapter (one prompt streams; a JSONL of prompts -> JSONL)",
    "bench": "compare every precision this machine runs: size, load time, prefill/decode tokens/s, peak memory, "
    "held-out perplexity",
    "eval": "score a model on lm-evaluation-harness tasks (acc, acc_norm): hellaswag, a task YAML, builtin:pydoc-mc",
}
COMMANDS = {  # name: (options, the function that runs them)
    "merge": (MergeConfig, "llmlab.infer.merge:merge_adapter"),
    "generate": (GenerateConfig, "llmlab.infer.generate:run_generate"),
    "bench": (BenchConfig, "llmlab.infer.bench:run_bench"),
    "eval": (EvalConfig, "llmlab.infer.evaluate:run_eval"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(HELP) + "}", parser_class=Parser)
    for name, (cls, _) in COMMANDS.items():
        add_dataclass_args(sub.add_parser(name, help=HELP[name], description=HELP[name]), cls)
    return parser


def log(message: str) -> None:
    print(message, file=sys.stderr if message.startswith("note:") else sys.stdout, flush=True)


@cli_entry
def main(argv: list[str] | None = None):
    ns = build_parser().parse_args(argv)
    cls, target = COMMANDS[ns.command]
    cfg = config_from_namespace(cls, ns)
    module, function = target.split(":")  # loaded after parsing: a bad flag answers before torch loads
    return getattr(importlib.import_module(module), function)(cfg, log=log)


if __name__ == "__main__":
    main()
