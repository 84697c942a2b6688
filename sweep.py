#!/usr/bin/env python
"""sweep: design-of-experiments on the minimal Transformer (or a GPT-2 preset), one process per trial.

  python sweep.py --grid doe20 --budget cpu --workers 2 --output_dir runs/doe20
  python sweep.py --grid lr_bs --model gpt2-tiny --lrs 1e-5 3e-5 --batch_sizes 8 16
  python sweep.py --grid my_grid.yaml           # `trials: [...]` or `factorial: {factor: [levels]}`
  python sweep.py recommend --from runs/lr_bs --memory-gb 24   # scaling-law recommendation (issue 5)
  python sweep.py contrast plan --arms adamw:cosine muon:cosine   # optimizers at their own lr, equal wall time

Rerunning the same command resumes: finished trials are skipped, crashed or interrupted ones rerun.
"""

from __future__ import annotations

import sys

from llmlab.core.errors import cli_entry


@cli_entry
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "recommend":
        from llmlab.scaling.recommend import recommend_main

        return recommend_main(argv[1:])
    if argv and argv[0] == "contrast":
        from llmlab.scaling.contrast import contrast_main

        return contrast_main(argv[1:])
    from llmlab.core.config import parse_config
    from llmlab.sweep.config import SweepConfig

    cfg = parse_config(
        SweepConfig, argv, description=__doc__.split("\n\n")[0] + " Subcommand: `sweep.py recommend --help`."
    )
    if not (cfg.grid == "lr_bs" and cfg.sizes):  # a size scan plans its grids as it runs
        from llmlab.sweep.design import build_design

        build_design(cfg)  # a bad grid answers in a second too, before torch and the statistics load
    from llmlab.scaling.scan import study_for  # after parsing: a bad flag answers before torch loads
    from llmlab.sweep.runner import FINISHED, run_sweep

    rows = run_sweep(cfg, study_for(cfg))
    statuses = {s: sum(r.get("status") == s for r in rows) for s in {r.get("status") for r in rows}}
    print(f"sweep done: {statuses}; report: {cfg.output_dir}/report.md")
    unfinished = sum(n for status, n in statuses.items() if status not in FINISHED)
    if unfinished:  # no outcome, so no data: the report lacks them until they run (a rerun runs them)
        print(
            f"note: {unfinished} trial(s) ended without an outcome (timed out, crashed or interrupted); rerun the same "
            "command to run them again (finished trials are kept), with a larger --trial_timeout if the machine is "
            "busy"
        )


if __name__ == "__main__":
    main()
