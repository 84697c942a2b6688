"""The held-out forecast's statistics: censored vertices, noise that grows with lr, verdict rules whose error rates
come from simulating the whole pipeline, and the pre-registered forecast the verdict judges."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from llmlab.scaling.optimum import CENSOR_SHARE, cell_optimum, grid_extension
from llmlab.scaling.simulate import Design, Truth, operating_characteristics
from llmlab.scaling.transfer import decide, holdout_verdict, seed_noise, size_points


def bowl(lrs, curvature=0.2, centre=3e-3, sigma=0.02, seeds=3, seed=0, noise_slope=0.0):
    rng = np.random.default_rng(seed)
    rows = []
    for lr in lrs:
        offset = math.log(lr / centre)
        for s in range(seeds):
            rows.append(
                {
                    "trial_id": f"lr{lr:.3g}-r{s}",
                    "size": "64x2",
                    "batch_size": 4.0,
                    "lr": lr,
                    "n_params": 65856.0,
                    "final_loss": 6.5
                    + curvature * offset**2
                    + rng.normal(0, sigma * math.exp(noise_slope / 2 * offset)),
                }
            )
    return rows


GRID = [3e-3 * 2 ** (k / 2) for k in range(-3, 4)]


def test_a_sharp_bowl_is_measured_with_an_interval_around_its_point_that_covers_the_truth():
    """One estimator for the point and its interval: the interval holds the point, and over 100 planted bowls its
    95 % covers the true optimum at least 92 % of the time."""
    point = cell_optimum(bowl(GRID), 0.02)
    assert point["status"] == "measured" and point["ci"][0] < point["lr_opt"] < point["ci"][1]
    assert point["censored_share"] < CENSOR_SHARE and point["windows"] >= 1 and point["var_ln"] > 0
    points = [cell_optimum(bowl(GRID, seed=seed), 0.02) for seed in range(100)]
    assert all(p["ci"][0] < p["lr_opt"] < p["ci"][1] for p in points if p["status"] == "measured")
    assert sum(p["status"] == "measured" and p["ci"][0] < 3e-3 < p["ci"][1] for p in points) >= 92


def test_a_flat_bowl_whose_draws_pile_at_the_edge_is_a_bound_not_a_value():
    # the minimum is interior, but at this noise the bootstrap puts many vertices past the grid's ends
    flat = bowl(GRID, curvature=0.01, sigma=0.03, seeds=2, seed=4)
    point = cell_optimum(flat, 0.03)
    assert point["status"] == "censored_low" and point["censored"]["low"] >= CENSOR_SHARE
    assert point.get("var_ln") is None and point.get("ci") is None  # never a variance from clipped draws
    lrs = sorted({r["lr"] for r in flat})
    means = [np.mean([r["final_loss"] for r in flat if r["lr"] == lr]) for lr in lrs]
    assert min(means) != means[0]  # the seed-mean minimum itself is interior: only the bootstrap sees the edge
    assert grid_extension(lrs, means, point["status"], 2**0.5) == [float(f"{lrs[0] / 2**0.5:.3g}")]


def test_the_estimator_averages_every_bracketing_window_so_no_window_is_chosen():
    rows = bowl(GRID + [3e-3 * 2**2, 3e-3 * 2**2.5], seed=5)
    point = cell_optimum(rows, 0.02)
    assert point["status"] == "measured" and point["windows"] >= 2


def test_noise_that_grows_with_lr_is_detected_and_used_only_then():
    lrs = [3e-3 * 2 ** (k / 2) for k in range(-4, 5)]
    rows = [dict(r, size=size) for size in "abc" for r in bowl(lrs, seeds=4, noise_slope=2.0, seed=ord(size))]
    trend = seed_noise(rows)["lr_trend"]
    assert trend["used"] and trend["ci"][0] < 2.0 < trend["ci"][1]
    flat = [dict(r, size=size) for size in "abc" for r in bowl(lrs, seeds=4, seed=ord(size))]
    trend = seed_noise(flat)["lr_trend"]
    assert not trend["used"] and trend["ci"][0] < 0 < trend["ci"][1]


@pytest.mark.parametrize(
    "ln_r, se, verdict",
    [
        (0.0, 0.1, "within 1.5x"),
        (math.log(2), 0.1, "failed"),
        (math.log(1.45), 0.05, "undecided"),  # excludes 1, inside the band
        (math.log(1.6), 0.5, "undecided"),
    ],
)  # outside the band, CI spans 1
def test_verdict_rule(ln_r, se, verdict):
    assert decide(ln_r, se, 20)["verdict"] == verdict


def test_the_registered_forecast_is_the_one_judged():
    rows = []
    for i, (size, n) in enumerate((("32x2", 16544.0), ("64x2", 65856.0), ("96x2", 147936.0), ("128x2", 262784.0))):
        centre = 4e-3 * (n / 16544) ** -0.5
        rows += [
            dict(r, size=size, n_params=n)
            for r in bowl([centre * 2 ** (k / 2) for k in range(-3, 4)], centre=centre, seed=i)
        ]
    points = size_points(rows, seed_noise(rows))
    refit = holdout_verdict(points)["rows"][0]
    law = {"ln_lr": math.log(refit["predicted"] * 2), "se_mean": 0.05, "se_pred": 0.05, "df": 1}
    registration = {"held_out": "128x2", "batch_size": 4.0, "forecast": {"law": law}}
    judged = holdout_verdict(points, registration=registration)["rows"][0]
    early = {**registration, "design": {"held_out_lrs": [1.0] * 7, "held_out_seeds": 6}}  # 42 planned, 21 ran
    waiting = holdout_verdict(points, registration=early)["rows"][0]
    assert waiting["verdict"] == "undecided" and "21 of the 42 registered" in waiting["reason"]
    assert not refit["registered"] and judged["registered"]
    assert judged["predicted"] == pytest.approx(2 * refit["predicted"]) and judged["df"] == 1
    assert judged["ratio"] == pytest.approx(2 * refit["ratio"])


def small_world(widths, depth: int, sigma: float = 0.01, **truth) -> tuple[Truth, Design]:
    """A sharp, quiet world (N = 24 w^2, the law through 3e-3 at the middle width) and a 5 x 2 design that holds the
    largest width out."""
    sizes = {f"{w}x{depth}": 24.0 * w**2 for w in widths}
    names = list(sizes)
    world = Truth(
        n_params=sizes,
        curvature={s: 0.2 for s in sizes},
        sigma={s: sigma for s in sizes},
        lr_at=(3e-3, sizes[names[len(names) // 2]]),
        centring_sd=0.1,
        **truth,
    )
    return world, Design(tuple(names[:-1]), names[-1], fit_lrs=5, fit_seeds=2, held_lrs=5, held_seeds=2)


def test_simulated_error_rates_separate_an_exact_forecast_from_a_2x_miss():
    truth, design = small_world((32, 64, 96, 128, 160, 320), depth=2)
    oc = operating_characteristics(truth, design, reps=6, seed=1)
    assert oc["trials"] == 5 * 5 * 2 + 5 * 2
    assert oc["exact"]["failed"] == 0 and oc["exact"]["within"] >= 0.5
    assert oc["2x"]["failed"] >= 0.5 and oc["2x"]["within"] == 0


def test_where_the_optimum_is_flat_the_simulation_judges_mups_flat_prediction_too():
    truth, design = small_world((64, 96, 128, 160, 224), depth=4, alpha=0.0)
    oc = operating_characteristics(truth, design, reps=6, seed=2)
    assert oc["summary"]["flat: P(within | exact)"] >= 0.5 and oc["exact"]["flat_ci_excludes_1"] <= 1 / 6
    assert oc["2x"]["flat_ci_excludes_1"] >= 0.5
    sloped = operating_characteristics(replace(truth, alpha=-0.3), design, reps=2, seed=2)
    assert not any(k.startswith("flat") for k in sloped["summary"])  # its misses are not the planted ones


def test_planted_scatter_about_the_law_spreads_the_forecasts_error_by_as_much():
    from llmlab.scaling.simulate import simulate_once

    exact_line, design = small_world((32, 64, 96, 128, 160, 320), depth=2, sigma=0.005)
    spread = {}
    for scatter in (0.0, 0.3):
        rng = np.random.default_rng(3)
        truth = replace(exact_line, law_scatter_sd=scatter)
        spread[scatter] = np.std([simulate_once(rng, truth, design, 1.0)["ln_r"] for _ in range(12)])
    # without scatter only the seed noise moves ln R; with it the held-out size's own 0.3 and the fit's error do
    assert spread[0.0] < 0.05 and spread[0.3] > 0.2, spread


def machine_blocked_bowl(seed: int, offset: float, sigma: float = 0.03) -> list[dict]:
    """The registered forecast's held-out cell as it ran: machine A ran the 4 lowest of 7 lrs x 6 seeds, machine B
    the rest of the registered grid and 3 complete blocks of its own; B's losses sit `offset` nats higher."""
    grid = [1.25e-3 * 2 ** (k / 2) for k in range(-2, 5)]
    rows = []
    for replicate in range(9):
        one_seed = bowl(grid, curvature=0.15, centre=1.25e-3, sigma=sigma, seeds=1, seed=seed * 100 + replicate)
        for k, row in enumerate(one_seed):
            machine = "A" if replicate < 6 and k < 4 else "B"
            rows.append(
                {
                    **row,
                    "trial_id": f"{row['trial_id']}-{replicate}",
                    "replicate": replicate,
                    "cpu": machine,
                    "final_loss": row["final_loss"] + (offset if machine == "B" else 0.0),
                }
            )
    return rows


def blocked_point(rows: list[dict]) -> dict:
    from llmlab.scaling.machines import machine_adjust

    adjusted, terms = machine_adjust(rows, ["A", "B"])
    noise = seed_noise(adjusted, {term["size"]: term["lost_df"] for term in terms})
    return size_points(adjusted, noise)[0]


def test_a_planted_machine_offset_moves_the_blocked_vertex_by_no_more_than_its_stated_error():
    # without noise the machine term removes the offset exactly, and the pooled estimator is pulled off
    exact = blocked_point(machine_blocked_bowl(0, 0.05, sigma=1e-9))
    truth = blocked_point(machine_blocked_bowl(0, 0.0, sigma=1e-9))
    assert exact["ln_lr_opt"] == pytest.approx(truth["ln_lr_opt"], abs=1e-6)
    pooled = size_points(
        machine_blocked_bowl(0, 0.05, sigma=1e-9), {"sigma": 1e-9, "df": 50, "per_size": {}, "lr_trend": {}}
    )[0]
    assert pooled["ln_lr_opt"] - truth["ln_lr_opt"] < -0.03  # a high-lr machine that loses more drags it low
    # with seed noise: the vertex lands within its stated 95 % interval of the no-offset truth as often as stated
    covered, errors = 0, []
    for seed in range(40):
        point = blocked_point(machine_blocked_bowl(seed, 0.05))
        assert point["status"] == "measured"
        covered += point["ci"][0] <= 1.25e-3 <= point["ci"][1]
        errors.append(point["ln_lr_opt"] - math.log(1.25e-3))
    assert covered >= 34  # >= 85 % of 40 at a nominal 95 % (binomial 5th percentile is 36)
    assert abs(np.mean(errors)) < 2 * np.std(errors) / math.sqrt(len(errors)) + 0.02  # no bias from the offset


def test_the_power_simulation_takes_its_world_from_the_fit_cells_noise_and_recovers_a_planted_law(tmp_path, capsys):
    """bench/forecast_design.py --fit_sizes: sigma per size and its growth with lr come from the fit cells' pure error
    (seeds at the same lr), the law from their vertices; planted values are recovered within their stated error."""
    import csv

    from llmlab.scaling.scan import size_parameters
    from tests.conftest import load_script

    bench = load_script("bench/forecast_design.py")
    alpha, slope, sizes = -0.3, 1.0, ("64x2", "96x3", "128x4", "160x5")
    rng, rows = np.random.default_rng(3), []
    n_ref = size_parameters("64x2", "minimal", 32)
    for size in sizes:
        n = size_parameters(size, "minimal", 32)
        ln_opt, sigma = math.log(5e-3) + alpha * math.log(n / n_ref), 0.03 * (n / n_ref) ** 0.1
        for k in range(7):
            offset = (k - 3) * math.log(2) / 2
            for seed in range(8):
                noise = rng.normal(0, sigma * math.exp(slope / 2 * offset))
                lr = math.exp(ln_opt + offset)
                rows.append({"trial_id": f"{size}_{k}_{seed}", "status": "ok", "size": size, "n_params": n,
                             "lr": lr, "batch_size": 4, "seed": seed, "final_loss": 6.5 + 0.1 * offset**2 + noise,
                             "initial_loss": 10.8, "train_tokens": 153600})  # fmt: skip
    with open(tmp_path / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    truths, facts = bench.scan_worlds(tmp_path, sizes, "224x7", head_dim=32, law_scatter=0.06)
    world = truths["as measured"]
    low, high = facts["shape"]["alpha_ci"]
    assert low <= alpha <= high and abs(world.alpha - alpha) < 0.15
    assert facts["lr_trend"]["used"] and 0.4 < world.noise_lr_slope < 1.6  # planted 1.0
    for size in sizes:  # each fit size's sigma (at its grid's centre) within a factor 1.5 of the planted one
        planted = 0.03 * (size_parameters(size, "minimal", 32) / n_ref) ** 0.1
        assert planted / 1.5 < world.sigma[size] < planted * 1.5, size
    assert world.sigma["224x7"] == pytest.approx(facts["held_out_sigma_extrapolated"])
    cautious = truths["sigma flat beyond the largest fit size"].sigma
    assert cautious["224x7"] == world.sigma["160x5"] and cautious["64x2"] == world.sigma["64x2"]
    # the plateau world: the fit cells' pooled sigma at every size, held-out included; every world plants the scatter
    pooled = facts["pooled_sigma"]["sigma"]
    plateau = truths[f"sigma {pooled:.3f} (pooled) at every size"].sigma
    assert set(plateau.values()) == {pooled} and min(world.sigma.values()) < pooled < max(world.sigma.values())
    assert {t.law_scatter_sd for t in truths.values()} == {0.06}
    assert facts["judged_on"] == ["as measured", "sigma flat beyond the largest fit size"]
    # a plateau measured elsewhere: a third judged world, sigma at least that past the largest fit size only
    floored, facts = bench.scan_worlds(tmp_path, sizes, "224x7", head_dim=32, sigma_plateau=0.5)
    name = "sigma at least 0.5 beyond the largest fit size"
    assert facts["judged_on"][-1] == name and floored[name].sigma["224x7"] == 0.5
    assert floored[name].sigma["160x5"] == world.sigma["160x5"]
    for flag, value, needle in (
        ("--sigma_plateau", "-0.04", "not a seed SD"),
        ("--law_scatter_from", str(tmp_path), "no scaling_fits.json"),
    ):
        with pytest.raises(SystemExit):
            bench.main(
                [
                    "--sigma_from",
                    str(tmp_path),
                    "--fit_sizes",
                    *sizes,
                    "--held_out",
                    "224x7",
                    flag,
                    value,
                    "--output",
                    str(tmp_path / "o.json"),
                ]
            )
        assert needle in capsys.readouterr().err and not (tmp_path / "o.json").exists()
    # larger designs follow the fit sizes' own rule: the depth dial here, more widths at one depth for a muP scan
    assert bench.larger_families(sizes)[0] == (bench.rule_sizes(2, 7), "288x9")
    assert bench.larger_families(("64x4", "96x4", "128x4"))[:2] == [
        (("64x4", "96x4", "128x4", "160x4"), "192x4"),
        (("64x4", "96x4", "128x4", "160x4", "192x4", "224x4"), "288x4"),
    ]


def sized_bowl(size: str, n_params: float, centre: float, seed: int) -> list[dict]:
    return [
        {**r, "size": size, "n_params": n_params, "status": "ok", "trial_id": f"{size}_{r['trial_id']}"}
        for r in bowl(GRID, centre=centre, sigma=0.01, seeds=3, seed=seed)
    ]


def test_a_mup_scan_registers_its_flat_prediction_and_the_verdict_judges_it(tmp_path):
    """muP's own claim (the optimum does not move with width) is registered beside the law's forecast, from the
    fit sizes alone, and judged against the held-out optimum by the same rule: within at a flat truth, failed at 2x."""
    import json
    from types import SimpleNamespace

    from llmlab.scaling.law import fit_law, predict
    from llmlab.scaling.report import verdict_markdown
    from llmlab.scaling.scan import preregister

    fit_sizes = {"64x4": 131648.0, "96x4": 295776.0, "128x4": 525440.0}
    rows = [r for k, (s, n) in enumerate(fit_sizes.items()) for r in sized_bowl(s, n, 3e-3, k)]
    # another batch size's cells, optimum elsewhere: the registered forecasts are the held-out cell's batch's
    other_batch = [
        {**r, "batch_size": 8.0} for k, (s, n) in enumerate(fit_sizes.items()) for r in sized_bowl(s, n, 5e-3, k)
    ]
    cell = {"size": "224x4", "batch_size": 4, "centre": 3e-3, "source": "law", "lrs": GRID, "seeds": 3}
    plan = {"cells": [], "machines": [], "n_params": {**fit_sizes, "224x4": 1605632.0}}
    registered = {}
    for parametrization in ("standard", "mup"):
        cfg = SimpleNamespace(
            parametrization=parametrization, model="minimal", blind_to=[], design_rationale=None, lr_step=2**0.5,
            max_lr_extensions=3, budget="cpu", steps=300, head_dim=32,
        )  # fmt: skip
        preregister(cfg, tmp_path / parametrization, plan, cell, rows + other_batch)
        registered[parametrization] = json.loads((tmp_path / parametrization / "preregistration.json").read_text())
    assert registered["standard"]["flat_forecast"] is None
    flat = registered["mup"]["flat_forecast"]
    assert flat["status"] == "ok" and flat["sizes"] == list(fit_sizes) and flat["df"] == 2
    fit_points = size_points(rows, seed_noise(rows))
    assert flat["ln_lr"] == pytest.approx(np.mean([p["ln_lr_opt"] for p in fit_points]))
    assert flat["lr"] == pytest.approx(3e-3, rel=0.15)
    law = fit_law(fit_points, with_batch=False)
    forecast = predict(law, 1605632.0, 4.0)
    registration = {
        **registered["mup"],
        "forecast": {"law": {k: forecast[k] for k in ("ln_lr", "se_mean", "se_pred")} | {"df": law["df"]}},
        "design": {"held_out_lrs": GRID, "held_out_seeds": 3},
    }
    verdicts = {}
    for truth in (3e-3, 6e-3):
        held = sized_bowl("224x4", 1605632.0, truth, 7)
        points = size_points(rows + held, seed_noise(rows + held))
        verdicts[truth] = holdout_verdict(points, registration=registration)
    assert verdicts[3e-3]["rows"][0]["flat"]["verdict"] == "within 1.5x"
    assert verdicts[6e-3]["rows"][0]["flat"]["verdict"] == "failed"
    assert verdicts[6e-3]["rows"][0]["flat"]["ratio"] == pytest.approx(0.5, rel=0.15)
    assert "**muP's flat prediction: failed**" in "\n".join(verdict_markdown(verdicts[6e-3]))


def test_a_scan_across_lengths_trains_each_size_its_steps_and_fits_beta_on_tokens(tmp_path):
    """`--sizes 128x12@150 ...`: one probe at several lengths. Each trial trains its label's steps with warmup
    keeping its share, the sizes sort by length, the law's axis is the training tokens D (the model's N kept aside),
    the report fits ln lr_opt = a + beta ln D on the fit lengths (what recommend --length_from reads), and a scan
    that varies both width and length, or several batch sizes, is refused in one line."""
    import json

    from llmlab.core.config import parse_config
    from llmlab.core.errors import UserError
    from llmlab.scaling.report import write_lr_bs_report
    from llmlab.scaling.scan import on_axis, scan_axis, scan_scale, scan_sizes
    from llmlab.sweep.config import SweepConfig
    from llmlab.sweep.runner import trial_specs

    argv = ["--grid", "lr_bs", "--model", "gpt2", "--budget", "cpu", "--batch_sizes", "4", "--steps", "300"]
    cfg = parse_config(SweepConfig, [*argv, "--sizes", "128x12@600", "128x12@150", "128x12@300"])
    sizes = scan_sizes(cfg)
    assert sizes == ["128x12@150", "128x12@300", "128x12@600"] and scan_axis(sizes) == "tokens"
    assert scan_scale(cfg, sizes, 4) == {"128x12@150": 76800, "128x12@300": 153600, "128x12@600": 307200}
    assert scan_axis(["64x12", "128x12"]) == "params"
    trial = {"trial_id": "t", "seed": 0, "replicate": 0, "lr": 1e-3, "batch_size": 4}
    design = [{**trial, "trial_id": size, "size": size} for size in sizes]
    specs = trial_specs(cfg, design, {"block_size": 128, "train_rows": 1000}, tmp_path)
    assert [s.steps for s in specs] == [150, 300, 600]  # the label's steps, not --steps
    assert [s.warmup_scale for s in specs] == pytest.approx([150 / 1800, 300 / 1800, 600 / 1800])  # a share
    for mixed, needle in (
        (["128x12@150", "256x12@300"], "the width or the length, not both"),
        (["128x12@150", "128x12"], "the width or the length, not both"),
    ):
        with pytest.raises(UserError, match=needle):
            parse_config(SweepConfig, [*argv, "--sizes", *mixed])
    with pytest.raises(UserError, match="one --batch_sizes"):
        parse_config(SweepConfig, [*argv[:-4], "--batch_sizes", "4", "8", "--sizes", "128x12@150", "128x12@300"])

    # a planted length law, beta -0.3: the optimum falls by 2^-0.3 per doubling of D
    tokens = {"128x12@150": 76800.0, "128x12@300": 153600.0, "128x12@600": 307200.0, "128x12@1200": 614400.0}
    rows = [
        {**r, "size": size, "n_params": 2.4e6, "train_tokens": d, "status": "ok", "trial_id": f"{size}_{r['trial_id']}"}
        for k, (size, d) in enumerate(tokens.items())
        for r in bowl(GRID, centre=3e-3 * (d / 76800.0) ** -0.3, sigma=0.01, seeds=3, seed=k)
    ]
    placed = on_axis(rows, {"axis": "tokens"})
    assert placed[0]["n_params"] == 76800.0 and placed[0]["n_params_model"] == 2.4e6
    assert on_axis(rows, {}) == rows  # a width scan's rows are left as they are
    write_lr_bs_report(tmp_path, placed, length_law=True)
    fits = json.loads((tmp_path / "scaling_fits.json").read_text())
    law = fits["length"]
    assert fits["transfer"]["holdout"]["size"] == "128x12@1200"  # the longest is held out (here unregistered)
    assert law["status"] == "ok" and law["lengths"] == list(tokens)[:3]  # fitted on the other three
    assert law["beta_ci"][0] < -0.3 < law["beta_ci"][1] and law["beta"] == pytest.approx(-0.3, abs=0.1)
    assert fits["measured"]["params"] == 2.4e6  # the model's N, not its tokens
    assert "A scan across training length: every N below is D" in (tmp_path / "scaling_report.md").read_text()


def test_the_power_simulation_of_a_length_scan_works_in_tokens_and_plants_the_null_beside_the_law(tmp_path):
    """bench/forecast_design.py on fit lengths (`128x12@STEPS`): each length's place is its training tokens D, the
    planted beta (ln lr_opt = a + beta ln D) is recovered, the flat null is a world of its own, longer designs add
    a length, and a trial is priced at its own steps."""
    import csv
    import json

    from tests.conftest import load_script

    bench = load_script("bench/forecast_design.py")
    beta, sizes, tokens_per_step = -0.3, ("128x12@150", "128x12@300", "128x12@600"), 4 * 128
    rng, rows = np.random.default_rng(5), []
    for size in sizes:
        steps = int(size.split("@")[1])
        ln_opt = math.log(2e-3) + beta * math.log(steps / 150)
        for k in range(7):
            offset = (k - 3) * math.log(2) / 2
            for seed in range(6):
                rows.append({"trial_id": f"{size}_{k}_{seed}", "status": "ok", "size": size, "n_params": 1e6,
                             "lr": math.exp(ln_opt + offset), "batch_size": 4, "seed": seed,
                             "final_loss": 6.5 + 0.1 * offset**2 + rng.normal(0, 0.01), "initial_loss": 10.8,
                             "train_tokens": steps * tokens_per_step})  # fmt: skip
    with open(tmp_path / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    truths, facts = bench.scan_worlds(tmp_path, sizes, "128x12@2400", head_dim=64)
    world = truths["as measured"]
    assert facts["axis"] == "tokens" and world.n_params["128x12@2400"] == 2400 * tokens_per_step
    low, high = facts["shape"]["alpha_ci"]
    assert low <= beta <= high and abs(world.alpha - beta) < 0.1
    assert truths["null holds: beta 0"].alpha == 0.0 and "muP holds: alpha 0" not in truths
    longer = bench.larger_families(sizes)
    assert longer == [(("128x12@150", "128x12@300", "128x12@600", "128x12@1200"), "128x12@4800")]
    for steps in (150, 300):  # two finished trials: 0.5 s a step and 20 s besides
        trial = tmp_path / "trials" / f"t{steps}"
        trial.mkdir(parents=True)
        result = {"status": "ok", "hparams": {"size": f"128x12@{steps}"}, "steps": steps, "time_per_step_s": 0.5,
                  "wall_time_s": steps * 0.5 + 20}  # fmt: skip
        (trial / "result.json").write_text(json.dumps(result))
    design = bench.Design(sizes, "128x12@2400", 7, 3, 7, 12)
    priced = bench.trial_hours(tmp_path, {"d": design}, truths)
    assert priced["trial_s"]["128x12@2400"] == 2400 * 0.5 + 20 and priced["trial_s"]["128x12@150"] == 95
