"""Training: one loop skeleton (llmlab.train.loop) that pretraining and LoRA build on, plus checkpoints and spikes."""
