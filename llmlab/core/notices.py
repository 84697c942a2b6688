"""Third-party notices known to be harmless, silenced by their exact text; every other warning still shows.

Each entry names the logger, the start of the message and why it can go: a newcomer's first run should show the
model learning, not six lines of other libraries talking to themselves.
"""

from __future__ import annotations

import logging
import sys

KNOWN_HARMLESS = (
    (
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community",
        "an optional 4-bit CPU kernel fetched from the hub; bitsandbytes falls back to its own (and training never "
        "uses 4-bit). Printed whenever peft is imported, which transformers' optimization module does",
    ),
    (
        "DeepSpeed",
        "Setting accelerator to CPU",
        "DeepSpeed's accelerator auto-detection reporting that there is no GPU, which the run already knows",
    ),
    (
        "lm_eval.models.huggingface",
        "`pretrained` model kwarg is not of type `str`",
        "llmlab hands the harness its live model on purpose (llmlab.infer.downstream), scoring it on one process",
    ),
    (
        "lm_eval.models.huggingface",
        "Passed an already-initialized model through `pretrained`",
        "the same choice, said a second time",
    ),
    (
        "accelerate.utils.other",
        "Removed shared tensor",
        "GPT-2 ties lm_head to the token embedding; safetensors stores the shared tensor once and loading re-ties it",
    ),
)


class _DropKnown(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def drop_known_notices() -> None:
    """Install the filters (once); cheap, so it can run at a package's import."""
    for name, prefix, _why in KNOWN_HARMLESS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropKnown(prefix))


def quiet_known_notices() -> None:
    """The filters, and transformers' per-file progress bars for saves and loads turned off."""
    drop_known_notices()
    # "Writing model shards" bars on every save of a model of a few MB. transformers takes its setting from
    # huggingface_hub's when it loads, so a script that has not imported it yet (a second, not its ~1 s) is covered.
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
