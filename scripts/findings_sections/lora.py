"""The LoRA default study: its table and summary."""

from __future__ import annotations

import json

from findings_sections.common import FINDINGS, interval, quoted, signed


def lora_results() -> dict:
    path = FINDINGS / "lora-default" / "results.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def lora_default_table(results: dict) -> str:
    """bench/lora_default.py's candidates: test-split perplexity, answer loss and ROUGE-L before -> after, with the
    paired bootstrap CIs train_lora.py wrote to eval.json."""
    lines = [
        "| candidate | wall time | test perplexity before → after (change, 95 % CI) | test answer loss (nats) | "
        "test ROUGE-L before → after (change, 95 % CI) |",
        "|---|---|---|---|---|",
    ]
    for name, result in results.items():
        report = result["report"]
        before, after, change = report["before"]["test"], report["after"]["test"], report["change"]["test"]
        ppl, rouge = change["perplexity"], change["rougeL"]
        lines.append(
            f"| {name} | {result['seconds'] / 60:.1f} min | {before['perplexity']:.0f} → "
            f"{after['perplexity']:.0f} ({signed(ppl['change'], 0)} {interval(*ppl['ci'], 0)}) | "
            f"{before['loss']:.2f} → {after['loss']:.2f} | {before['rougeL']:.3f} → {after['rougeL']:.3f} "
            f"({signed(rouge['change'])} {interval(*rouge['ci'])}) |"
        )
    return "\n".join(lines)


def lora_default_summary() -> str:
    """The chosen default's before -> after on the test split, and two of its answers."""
    results = lora_results()
    if not results:
        return "_bench/lora_default.py has not been run yet_"
    name, result = min(results.items(), key=lambda item: item[1]["report"]["after"]["test"]["loss"])
    report = result["report"]
    before, after, change = report["before"]["test"], report["after"]["test"], report["change"]["test"]
    ppl, rouge = change["perplexity"], change["rougeL"]
    lines = [
        "| test split | before | after | change (95 % CI, paired bootstrap) |",
        "|---|---|---|---|",
        f"| perplexity ({report['test_examples']} examples) | {before['perplexity']:.0f} | "
        f"{after['perplexity']:.0f} | {signed(ppl['change'], 0)} {interval(*ppl['ci'], 0)} |",
        f"| answer loss, nats | {before['loss']:.2f} | {after['loss']:.2f} | |",
        f"| ROUGE-L ({rouge['examples']} greedy answers) | {before['rougeL']:.3f} | {after['rougeL']:.3f} | "
        f"{signed(rouge['change'])} {interval(*rouge['ci'])} |",
    ]
    shown = [e for e in report["examples"] if e["after"].strip()][:2] or report["examples"][:2]
    answers = [
        f"- {e['instruction']} Reference: {quoted(e['reference'])}; before: {quoted(e['before'])}; after: "
        f"{quoted(e['after'])}"
        for e in shown
    ]
    return "\n".join(
        [
            f"Defaults = {name}: {result['seconds'] / 60:.1f} min wall on 2 cores, both evaluations included.",
            "",
            *lines,
            "",
            *answers,
        ]
    )
