"""The data pipeline at scale: throughput, memory, near-duplicate quality, one huge document, MinHash speed."""

from __future__ import annotations

import json

from findings_sections.common import FINDINGS


def data_scale() -> str:
    """bench/data_scale.py's table, slopes and projections, from docs/findings/data-scale/results.json."""
    path = FINDINGS / "data-scale" / "results.json"
    if not path.is_file():
        return "_bench/data_scale.py has not run yet_"
    data = json.loads(path.read_text())
    lines = [
        "| corpus | pipeline | tokens | seconds | tokens/s | peak memory (PSS, MB) | bytes / token |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        name = r["pipeline"] + (f" (earlier run, {r['machine']})" if r.get("earlier_run") else "")
        lines.append(
            f"| {r['corpus_mb']} MB | {name} | {r['tokens']:,} | {r['seconds']:.1f} | "
            f"{r['tokens_per_second']:,.0f} | {r['peak_rss_mb']:,.0f} | {r['bytes_per_token']:.2f} |"
        )
    s = data["summary"]
    lines += [
        "",
        "| pipeline | memory: base + per 100M tokens (per document) | 1B tokens: hours, disk GB, "
        "peak GB | 10B tokens: hours, "
        "disk GB, peak GB |",
        "|---|---|---|---|",
    ]
    for name, fit in s.items():
        if name == "ratios":
            continue
        p1, p10 = fit["projection"]["1B"], fit["projection"]["10B"]
        lines.append(
            f"| {name} | {fit['rss_base_mb']:,.0f} MB + {fit['rss_mb_per_100m_tokens']:,.0f} MB "
            f"({fit['rss_kb_per_document']:.1f} KB) | "
            f"{p1['hours']:.1f} h, {p1['disk_gb']:.0f} GB, {p1['peak_rss_gb']:.1f} GB | {p10['hours']:.1f} h, "
            f"{p10['disk_gb']:.0f} GB, {p10['peak_rss_gb']:.1f} GB |"
        )
    ratios = "; ".join(f"{k.replace(' tokens/s', '')} = {v:.2f}×" for k, v in s.get("ratios", {}).items())
    loader = data.get("loader") or {}
    wait = (
        f" Training on the {data['sizes_mb'][-1]} MB shards ({loader['steps']} steps of gpt2-tiny): the loader "
        f"waited {100 * loader['data_wait_share_max']:.3f} % of step time at most."
        if "steps" in loader
        else ""
    )
    return "\n".join(lines) + (
        f"\n\nSide by side in one run on {data['machine']}, {data['workers']} workers: tokens/s ratios {ratios}.{wait}"
    )


def data_scale_summary() -> str:
    """The README's sentence on data at scale with the defaults (near-dup on): the largest corpus's peak memory and
    its speed against nanoGPT's recipe side by side, the line fit's projection, the disk bytes."""
    data = json.loads((FINDINGS / "data-scale" / "results.json").read_text())
    fit = data["summary"]["llmlab"]
    largest = data["sizes_mb"][-1]
    row = [r for r in data["rows"] if r["pipeline"] == "llmlab" and r["corpus_mb"] == largest][-1]
    ratio = data["summary"]["ratios"][f"{largest} MB llmlab / nanogpt tokens/s"]
    ten = fit["projection"]["10B"]
    per_doc = row["dedup"]["near_dup_disk_bytes_per_document"]
    return (
        f"With the defaults, near-dup on, {largest:,} MB of text ({row['tokens'] / 1e6:.0f}M tokens) prepared at "
        f"{ratio:.2f}× the tokens/s of nanoGPT's recipe side by side, with a {row['peak_rss_mb']:,.0f} MB peak. A line "
        f"through the three sizes gives {fit['rss_base_mb']:,.0f} MB + {fit['rss_mb_per_100m_tokens']:.0f} MB per 100M "
        f"tokens, {ten['peak_rss_gb']:.1f} GB at 10B tokens"
        f". Near-dup's band keys take {per_doc:.0f} bytes a document on disk while it runs "
        f"({per_doc * 1e10 / (row['tokens'] / row['documents']) / 1e9:.1f} GB at 10B tokens of these documents)."
    )


def near_dup_quality() -> str:
    """bench/near_dup_quality.py's planted-pair curve: share removed per Jaccard bin, recall and precision."""
    data = json.loads((FINDINGS / "data-scale" / "near_dup_quality.json").read_text())
    lines = ["| Jaccard to its original | planted copies | removed | share (95 % CI) |", "|---|---|---|---|"]
    for row in data["bins"]:
        share = (
            "–"
            if row["share_removed"] is None
            else (f"{row['share_removed']:.3f} [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]")
        )
        lines.append(
            f"| [{row['jaccard_from']:.3f}, {row['jaccard_to']:.3f}) | {row['copies']} | {row['removed']} | {share} |"
        )
    s = data["summary"]
    return "\n".join(lines) + (
        f"\n\n{data['bases']} originals and one planted copy of each, prepared by the pipeline (threshold "
        f"{data['threshold']}, two workers, copies in later files and shards) on {data['machine']}: recall "
        f"{s['recall_at_0.9']:.3f} at Jaccard ≥ 0.9 and {s['recall_at_threshold']:.3f} at ≥ {data['threshold']}, "
        f"precision {s['precision']:.3f} ({s['removed_below_threshold']} copies below the threshold and "
        f"{s['bases_removed']} originals removed)."
    )


def near_dup_groups() -> str:
    """bench/near_dup_quality.py --copies 2 10 --before: recall per group size, now and before, side by side."""
    data = json.loads((FINDINGS / "data-scale" / "near_dup_groups.json").read_text())
    before = data["before"]
    lines = ["| group size (copies of one base) | true duplicates | recall now (95 % CI) | recall before |",
             "|---|---|---|---|"]  # fmt: skip
    for now_row, old_row in zip(data["by_group_size"], before["by_group_size"]):
        lines.append(
            f"| {now_row['group_size']} | {now_row['true_duplicates']} | {now_row['recall']:.3f} "
            f"[{now_row['ci95'][0]:.3f}, {now_row['ci95'][1]:.3f}] | {old_row['recall']:.3f} |"
        )
    s, b = data["summary"], before["summary"]
    copies = sum(row["copies"] for row in data["bins"])
    return "\n".join(lines) + (
        f"\n\n{data['bases']} bases, each with {data['copies_per_base'][0]}-{data['copies_per_base'][1]} copies "
        f"({copies} in all, each with 0-6 % of its words replaced on its own, shuffled after the bases), threshold "
        f"{data['threshold']}, on {data['machine']}. Copies at Jaccard ≥ {data['threshold']} to their base that "
        f"survive: {s['surviving_true_duplicates']} now, {b['surviving_true_duplicates']} before ({before['commit']}): "
        f"recall {s['recall_at_threshold']:.4f} against {b['recall_at_threshold']:.4f}. Precision "
        f"{s['precision']:.3f} now and {b['precision']:.3f} before: {s['removed_below_threshold']} copies below the "
        f"threshold and {s['bases_removed']} bases removed. The near-dup stage took {s['near_dup_seconds']:.1f} s "
        f"now and {b['near_dup_seconds']:.1f} s before ({s['near_dup_seconds'] / b['near_dup_seconds']:.2f}x, one "
        f"run each, side by side), its disk {s['near_dup_disk_bytes_per_document']:.0f} bytes a document against "
        f"{b['near_dup_disk_bytes_per_document']:.0f}."
    )


def one_document() -> str:
    """bench/one_document.py: peak memory against the size of a one-document corpus, now and before."""
    data = json.loads((FINDINGS / "data-scale" / "one_document.json").read_text())
    rows = {(r["tree"], r["document_mb"]): r for r in data["rows"]}
    lines = ["| one document of | peak now | peak before | tokens | seconds now |", "|---|---|---|---|---|"]
    for size in sorted({mb for _, mb in rows}):
        now, old = rows[("now", size)], rows.get(("before", size))
        before = f"{old['peak_rss_mb']:,.0f} MB" if old else "not run"
        lines.append(
            f"| {size:,} MB | {now['peak_rss_mb']:,.0f} MB | {before} | {now['tokens']:,} | {now['seconds']:.0f} |"
        )
    refused = data["json_line"]
    return "\n".join(lines) + (
        f"\n\nPeak PSS of the whole process tree ({data['workers']} workers), the corpus a single .txt.gz; before = "
        f"{data['before']}, run side by side up to 256 MB. A single JSON line of {data['json_line_gb']:g} GB is "
        f"refused in {refused['seconds']:.0f} s, before it is read whole. On {data['machine']}."
    )


def minhash_speed() -> str:
    """bench/minhash_speed.py's table: signature cost per token against tiktoken's, one core."""
    data = json.loads((FINDINGS / "data-scale" / "minhash_speed.json").read_text())
    lines = ["| candidate | median s | tokens/s | time × tiktoken's |", "|---|---|---|---|"]
    for row in data["rows"]:
        if row["installed"]:
            cells = (
                row["candidate"],
                f"{row['median_s']:.3f}",
                f"{row['tokens_per_s']:,}",
                f"{row['cost_vs_tiktoken']:.2f}",
            )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        f"\n\n{data['documents']:,} documents ({data['tokens']:,} tokens), one core, median of {data['repeats']} "
        f"interleaved runs on {data['cpu']}."
    )
