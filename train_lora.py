#!/usr/bin/env python
"""Adapt a pretrained causal LM to a domain with LoRA, and measure it before and after.

    python train_lora.py                                  # runs/pretrain/final -> builtin:pydoc
    accelerate launch train_lora.py --base_model gpt2 --dataset my_data.jsonl --target_modules c_attn
    python train_lora.py --resume_from_checkpoint latest  # continue an interrupted run exactly

Writes output_dir (runs/lora): adapter/ (peft save_pretrained, the best adapter by validation loss),
eval.json (test and validation perplexity and ROUGE-L before/after, with CIs), checkpoints/step_N (resumable,
adapter-only), config.yaml, run_info.json, tensorboard/.
"""

from llmlab.core.config import parse_config
from llmlab.core.errors import cli_entry
from llmlab.train.lora.config import LoraTrainConfig, check_base_model


@cli_entry
def main(argv=None):
    cfg = parse_config(LoraTrainConfig, argv, description=__doc__.splitlines()[0])
    check_base_model(cfg)  # the most common first-run mistake answers at once, not after the stack loads
    from llmlab.train.lora.loop import train  # after the options are checked: the training stack takes ~2 s to load

    train(cfg)


if __name__ == "__main__":
    main()
