"""Scaling laws from small lr x batch-size sweeps: feasible region, robust fits, report, recommendation."""
from llmlab.scaling.fits import ScalingOptions, analyse, feasible_region, fit_loglinear, lr_optimum, predict_band
from llmlab.scaling.recommend import RecommendConfig, recommend, recommend_main
from llmlab.scaling.report import FITS_FILE, REPORT_FILE, write_lr_bs_report

__all__ = ["ScalingOptions", "RecommendConfig", "analyse", "feasible_region", "fit_loglinear", "lr_optimum",
           "predict_band", "recommend", "recommend_main", "write_lr_bs_report", "FITS_FILE", "REPORT_FILE"]
