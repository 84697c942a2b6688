"""The scaling study, in one place: the lr scans that run it (`scan`: the multi-size scan, its registration and the
machines it admits, run by the lab's runner as a `Study`), what they measure (per-size optima, the law across sizes
and across training lengths, the held-out verdict, single-size fits, the report), and `recommend`, which turns them
(and a doe sweep's resolved contrasts) into a trainer's config. The analysis modules import no sweep machinery."""

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
