"""After training: load at a precision, quantize, merge an adapter, generate, and benchmark precisions."""
