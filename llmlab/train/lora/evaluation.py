"""Evaluation for LoRA runs: loss/perplexity, greedy answers scored with ROUGE-L, and the before/after report.

Two splits are measured before and after training: validation (which early stopping and model selection use, so its
"after" is optimistic) and a fixed test split that neither ever sees. Perplexity is exp(mean token loss on the answer
tokens + eos) over the whole split, summed exactly across processes. ROUGE-L is rouge_score's F-measure with stemming
(works offline), over a bounded number of the split's examples answered greedily on the main process. Every
after - before difference carries a paired bootstrap 95 % CI over examples (scipy.stats.bootstrap).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.utils import broadcast_object_list
from rouge_score.rouge_scorer import RougeScorer
from scipy import stats

from llmlab.data.instruct import collate_prompts
from llmlab.train.loss import causal_lm_loss, perplexity


def supports_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def answer_logits(model, batch: dict, mode: str = "full", head=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, targets, row) of every answer token: the logits that predict it, its id, its batch row.

    Prompt positions carry no loss, and for a small model the hidden x vocabulary projection dominates
    the step, so it is only computed where it counts:
      "gather": the model returns its final hidden states (and logits for one position only); `head`
                (the frozen output embedding) projects just the positions that predict answer tokens.
      "trim":   `logits_to_keep` from the batch's first answer position on (for models whose logits are
                not a plain head(hidden), e.g. soft-capped ones, see `pick_logits_mode`).
      "full":   every position (models without `logits_to_keep`).
    The gradient still flows through the (DDP-wrapped) model's forward, so multi-GPU sync is unchanged.
    """
    input_ids, attention, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    targets = labels[:, 1:]
    if mode == "gather":
        out = model(input_ids=input_ids, attention_mask=attention, output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1][:, :-1]
        wanted = targets != -100
        return head(hidden[wanted].to(head.weight.dtype)), targets[wanted], wanted.nonzero()[:, 0]
    if mode == "trim":
        first_labelled = int((labels != -100).any(0).float().argmax())
        keep = min(labels.shape[1], labels.shape[1] - first_labelled + 1)
        logits = model(input_ids=input_ids, attention_mask=attention, logits_to_keep=keep).logits[:, :-1]
        targets = targets[:, -(keep - 1) :] if keep > 1 else targets[:, :0]
    else:
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
    wanted = targets != -100
    return logits[wanted], targets[wanted], wanted.nonzero()[:, 0]


def answer_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """llmlab's causal_lm_loss on the answer tokens, laid out as one sequence it can shift."""
    sequence_logits = torch.cat([logits, logits.new_zeros(1, logits.shape[-1])])[None]  # last one predicts nothing
    sequence_labels = torch.cat([targets.new_full((1,), -100), targets])[None]  # first one is never predicted
    return causal_lm_loss(sequence_logits, sequence_labels, label_smoothing)


@torch.no_grad()
def pick_logits_mode(model, batch: dict) -> str:
    """The cheapest answer_logits mode that reproduces this model's own logits on `batch`."""
    if not supports_logits_to_keep(model):
        return "full"
    head = model.get_output_embeddings()
    if head is None or any("lora_" in name for name, _ in head.named_parameters()):
        return "trim"  # an adapted head must run inside the model's forward
    was_training = model.training
    model.eval()
    reference, _, _ = answer_logits(model, batch, "full")
    gathered, _, _ = answer_logits(model, batch, "gather", head)
    model.train(was_training)
    close = gathered.shape == reference.shape and torch.allclose(gathered, reference, atol=1e-4, rtol=1e-4)
    return "gather" if close else "trim"


@torch.no_grad()
def adapter_validation_loss(model, val_loader, accelerator, mode: str = "full", head=None) -> float:
    """Mean next-token cross-entropy over every labelled token of a split."""
    sums, counts = example_losses(model, val_loader, accelerator, mode, head)
    return float(sums.sum() / counts.sum().clamp(min=1))


@torch.no_grad()
def example_losses(model, val_loader, accelerator, mode: str = "full", head=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example of a split, in order: the summed token loss of its answer and its number of answer tokens."""
    model.eval()
    loss_sums, token_counts = [], []
    for batch in val_loader:
        logits, targets, rows = answer_logits(model, batch, mode, head)
        token_loss = F.cross_entropy(logits.float(), targets, reduction="none")
        size = batch["labels"].shape[0]
        # Per-example sums so gather_for_metrics can drop the padding samples a sharded loader adds.
        per_example = torch.stack(
            [
                torch.zeros(size, device=token_loss.device).index_add_(0, rows, token_loss),
                torch.bincount(rows, minlength=size).float(),
            ],
            dim=1,
        )
        gathered = accelerator.gather_for_metrics(per_example)
        loss_sums.append(gathered[:, 0])
        token_counts.append(gathered[:, 1])
    return torch.cat(loss_sums).cpu(), torch.cat(token_counts).cpu()


@torch.no_grad()
def generate_ids(
    model, eos_id: int, examples: list[dict], pad_id: int, batch_size: int, max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations of the examples' prompts (left-padded batches), up to and without eos."""

    model.eval()
    device = next(model.parameters()).device
    limit = model.config.max_position_embeddings
    continuations = []
    for start in range(0, len(examples), batch_size):
        batch = collate_prompts(examples[start : start + batch_size], pad_id)
        width = batch["input_ids"].shape[1]
        output = model.generate(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            do_sample=False,
            max_new_tokens=max(1, min(max_new_tokens, limit - width)),
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        for row in output[:, width:].tolist():
            continuations.append(row[: row.index(eos_id)] if eos_id in row else row)
    return continuations


def generate_answers(
    model, tokenizer, examples: list[dict], pad_id: int, batch_size: int, max_new_tokens: int
) -> list[str]:
    ids = generate_ids(model, tokenizer.eos_token_id, examples, pad_id, batch_size, max_new_tokens)
    return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def rouge_scores(predictions: list[str], references: list[str]) -> list[float]:
    scorer = RougeScorer(["rougeL"], use_stemmer=True)
    return [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references)]


def evaluate_split(
    model,
    *,
    accelerator,
    tokenizer,
    loader,
    rouge_examples: list[dict],
    pad_id: int,
    batch_size: int,
    max_new_tokens: int,
    mode: str = "full",
    head=None,
) -> dict:
    """loss and perplexity (all processes) and ROUGE-L + generations (main process, then shared) of one split,
    with the per-example numbers the paired bootstrap needs."""
    sums, counts = example_losses(model, loader, accelerator, mode, head)
    loss = float(sums.sum() / counts.sum().clamp(min=1))
    shared = [None, None]
    if accelerator.is_main_process and rouge_examples:
        with accelerator.autocast():
            generations = generate_answers(
                accelerator.unwrap_model(model), tokenizer, rouge_examples, pad_id, batch_size, max_new_tokens
            )
        shared = [rouge_scores(generations, [e["record"]["output"].strip() for e in rouge_examples]), generations]
    if accelerator.num_processes > 1:
        broadcast_object_list(shared)
    scores = shared[0]
    return {
        "loss": loss,
        "perplexity": perplexity(loss),
        "rougeL": sum(scores) / len(scores) if scores else None,
        "generations": shared[1],
        "example_loss": sums.tolist(),
        "example_tokens": counts.tolist(),
        "example_rougeL": scores,
    }


def paired_change(before: dict, after: dict, seed: int = 0) -> dict:
    """after - before of perplexity and ROUGE-L with paired bootstrap 95 % CIs over the split's examples."""
    loss_b, tokens, loss_a = (
        np.array(before["example_loss"]),
        np.array(before["example_tokens"]),
        np.array(after["example_loss"]),
    )

    def ppl_change(lb, tok, la, axis=-1):
        return np.exp(la.sum(axis) / tok.sum(axis)) - np.exp(lb.sum(axis) / tok.sum(axis))

    out = {"perplexity": _bootstrap((loss_b, tokens, loss_a), ppl_change, seed)}
    if before.get("example_rougeL") and after.get("example_rougeL"):
        rouge = (np.array(before["example_rougeL"]), np.array(after["example_rougeL"]))
        out["rougeL"] = _bootstrap(rouge, lambda b, a, axis=-1: a.mean(axis) - b.mean(axis), seed)
    return out


def _bootstrap(data: tuple, statistic, seed: int) -> dict:
    value = float(statistic(*data))
    if len(data[0]) < 2 or all(float(np.std(d)) == 0 for d in data):  # nothing varies: the interval is the value
        return {"change": value, "ci": [value, value], "examples": len(data[0])}
    result = stats.bootstrap(
        data,
        statistic,
        paired=True,
        vectorized=True,
        n_resamples=2000,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    low, high = result.confidence_interval
    return {"change": value, "ci": [float(low), float(high)], "examples": len(data[0])}


def samples_markdown(accelerator, model, tokenizer, examples: list[dict], pad_id: int, max_new_tokens: int) -> str:
    """A few prompts with reference and generated answers, as Markdown for TensorBoard's text tab."""
    if not accelerator.is_main_process:
        return ""
    with accelerator.autocast():
        answers = generate_answers(
            accelerator.unwrap_model(model), tokenizer, examples, pad_id, len(examples), max_new_tokens
        )
    blocks = []
    for example, answer in zip(examples, answers):
        record = example["record"]
        prompt = f"{record['instruction']}" + (f"  \n`{record['input']}`" if record["input"] else "")
        blocks.append(f"**Q:** {prompt}  \n**reference:** {record['output']}  \n**model:** {answer or '(empty)'}")
    return "\n\n---\n\n".join(blocks)


def example_rows(examples: list[dict], before: list[str] | None, after: list[str] | None, limit: int = 5) -> list[dict]:
    rows = []
    for i, example in enumerate(examples[:limit]):
        record = example["record"]
        rows.append(
            {
                "instruction": record["instruction"],
                "input": record["input"],
                "reference": record["output"],
                "before": before[i] if before else None,
                "after": after[i] if after else None,
            }
        )
    return rows


def before_after_table(report: dict) -> str:
    lines = [f"{'metric':<22}{'before':>11}{'after':>11}{'change (95 % CI)':>32}"]
    for split in [s for s in ("test", "validation") if s in report["after"]]:
        for key in ("perplexity", "rougeL"):
            b, a = report["before"][split][key], report["after"][split][key]
            change = report["change"][split].get(key)
            if b is None or a is None:
                lines.append(f"{split + ' ' + key:<22}{'-':>11}{'-':>11}{'-':>32}")
                continue
            interval = f"{change['change']:+.4g} [{change['ci'][0]:+.4g}, {change['ci'][1]:+.4g}]" if change else "-"
            lines.append(f"{split + ' ' + key:<22}{b:>11.4g}{a:>11.4g}{interval:>32}")
    lines.append(
        f"(test: {report['test_examples']} examples no choice ever saw; validation: {report['val_examples']} "
        f"examples, used by early stopping; ROUGE-L on {report['rouge_examples']} of each; best adapter at "
        f"step {report['best_step']} of {report['steps']}" + ("; stopped early)" if report["stopped_early"] else ")")
    )
    return "\n".join(lines)
