"""LoRA domain adaptation: its options (config.py), the adapted model (model.py), before/after evaluation
(evaluation.py) and its loop (loop.py)."""
