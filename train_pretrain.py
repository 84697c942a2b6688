#!/usr/bin/env python
"""Pretrain GPT-2 (gpt2-tiny by default) on the offline corpus with accelerate / DeepSpeed ZeRO-2.

accelerate launch train_pretrain.py                      # gpt2-tiny, a few minutes on CPU
accelerate launch --config_file accelerate_configs/one_gpu_zero2_offload.yaml train_pretrain.py --model gpt2
python train_pretrain.py --prepare_only --dataset corpus.jsonl --output_dir runs/data
"""

from pathlib import Path

from llmlab.core.config import parse_config
from llmlab.core.errors import cli_entry
from llmlab.core.io import atomic_write_json
from llmlab.data.prepare import format_prepare_summary, prepare_dataset
from llmlab.train.pretrain.config import PretrainConfig


@cli_entry
def main(argv=None):
    cfg = parse_config(PretrainConfig, argv, description=__doc__.splitlines()[0])
    if cfg.prepare_only:
        data = prepare_dataset(cfg.data_config())
        atomic_write_json(Path(cfg.output_dir) / "prepare_report.json", data.report)
        print(format_prepare_summary(data.report))
        return
    from llmlab.train.pretrain.loop import train  # after the options are checked: the training stack takes ~2 s to load

    summary = train(cfg)
    print(f"done: {summary['step']} steps, validation loss {summary['val_loss']}, model in {summary['final_dir']}")


if __name__ == "__main__":
    main()
