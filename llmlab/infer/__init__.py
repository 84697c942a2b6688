"""After training: load at a precision, quantize, merge an adapter, generate, and benchmark precisions."""

from llmlab.core.notices import drop_known_notices

# Before any submodule imports peft: peft imports bitsandbytes, which logs a known-harmless kernel notice at import.
drop_known_notices()
