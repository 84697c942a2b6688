"""Training: the parts a trainer is made of (session, engine, loss, checkpoints, meter) and the two trainers built
from them (pretrain/, lora/)."""

from llmlab.core.notices import drop_known_notices

# Before any submodule imports peft (lora_model, and transformers' optimization module for Adafactor): peft imports
# bitsandbytes, which logs a known-harmless kernel notice at import.
drop_known_notices()
