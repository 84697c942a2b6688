"""llmlab: the small common package behind train_pretrain.py, train_lora.py, sweep.py and merge_and_infer.py."""

__version__ = "0.1.0"
