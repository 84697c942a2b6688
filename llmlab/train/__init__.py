"""Training: one loop skeleton (llmlab.train.loop) that pretraining and LoRA build on, plus checkpoints and spikes."""

from llmlab.core.notices import drop_known_notices

# Before any submodule imports peft (lora_model, and transformers' optimization module for Adafactor): peft imports
# bitsandbytes, which logs a known-harmless kernel notice at import.
drop_known_notices()
