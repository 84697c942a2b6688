"""GPT-2 pretraining: its options (config.py), the parts it sets up (setup.py) and its loop (loop.py)."""
