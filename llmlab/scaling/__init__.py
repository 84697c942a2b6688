"""Scaling laws from small lr x batch-size sweeps: per-size optima, the law across sizes, its held-out verdict,
single-size fits and report (recommendations, which also read a doe sweep, are llmlab.sweep.recommend)."""

from llmlab.scaling.analysis import analyse
from llmlab.scaling.fits import ScalingOptions, feasible_region, fit_loglinear, lr_optimum, predict_band
from llmlab.scaling.report import FITS_FILE, REPORT_FILE, write_lr_bs_report

__all__ = [
    "ScalingOptions",
    "analyse",
    "feasible_region",
    "fit_loglinear",
    "lr_optimum",
    "predict_band",
    "write_lr_bs_report",
    "FITS_FILE",
    "REPORT_FILE",
]
