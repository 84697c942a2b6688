"""The models this project trains: GPT-2 presets, the lab's minimal Transformer, and their FLOP counts."""
