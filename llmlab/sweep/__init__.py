"""Subprocess-isolated hyperparameter sweeps: designs, trial process, runner, report (see sweep.py)."""
