"""Scaling laws from small lr x batch-size sweeps: per-size optima, the law across sizes, its held-out verdict,
single-size fits, report and recommendation."""
from llmlab.scaling.analysis import analyse
from llmlab.scaling.fits import ScalingOptions, feasible_region, fit_loglinear, lr_optimum, predict_band
from llmlab.scaling.recommend import RecommendConfig, recommend, recommend_main
from llmlab.scaling.report import FITS_FILE, REPORT_FILE, write_lr_bs_report

__all__ = ["ScalingOptions", "RecommendConfig", "analyse", "feasible_region", "fit_loglinear", "lr_optimum",
           "predict_band", "recommend", "recommend_main", "write_lr_bs_report", "FITS_FILE", "REPORT_FILE"]
