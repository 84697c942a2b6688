"""Evaluation for LoRA runs: validation loss/perplexity, greedy answers scored with ROUGE-L, and reports.

Perplexity is exp(mean token loss on the answer tokens + eos) over the whole validation split, summed
exactly across processes. ROUGE-L is rouge_score's F-measure with stemming (works offline), averaged
over a bounded number of validation examples whose answers are generated greedily on the main process.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmlab.data.instruct import collate_prompts
from llmlab.train.common import perplexity


def supports_logits_to_keep(model) -> bool:
    import inspect

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
        targets = targets[:, -(keep - 1):] if keep > 1 else targets[:, :0]
    else:
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
    wanted = targets != -100
    return logits[wanted], targets[wanted], wanted.nonzero()[:, 0]


def answer_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """llmlab's causal_lm_loss on the answer tokens, laid out as one sequence it can shift."""
    from llmlab.train.common import causal_lm_loss

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
    """Mean next-token cross-entropy over every labelled token of the validation split."""
    model.eval()
    loss_sums, token_counts = [], []
    for batch in val_loader:
        logits, targets, rows = answer_logits(model, batch, mode, head)
        token_loss = F.cross_entropy(logits.float(), targets, reduction="none")
        size = batch["labels"].shape[0]
        # Per-example sums so gather_for_metrics can drop the padding samples a sharded loader adds.
        per_example = torch.stack([torch.zeros(size, device=token_loss.device).index_add_(0, rows, token_loss),
                                   torch.bincount(rows, minlength=size).float()], dim=1)
        gathered = accelerator.gather_for_metrics(per_example)
        loss_sums.append(gathered[:, 0])
        token_counts.append(gathered[:, 1])
    return float(torch.cat(loss_sums).sum() / torch.cat(token_counts).sum().clamp(min=1))


@torch.no_grad()
def generate_ids(model, eos_id: int, examples: list[dict], pad_id: int, batch_size: int,
                 max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of the examples' prompts (left-padded batches), up to and without eos."""

    model.eval()
    device = next(model.parameters()).device
    limit = model.config.max_position_embeddings
    continuations = []
    for start in range(0, len(examples), batch_size):
        batch = collate_prompts(examples[start: start + batch_size], pad_id)
        width = batch["input_ids"].shape[1]
        output = model.generate(input_ids=batch["input_ids"].to(device),
                                attention_mask=batch["attention_mask"].to(device), do_sample=False,
                                max_new_tokens=max(1, min(max_new_tokens, limit - width)),
                                eos_token_id=eos_id, pad_token_id=pad_id)
        for row in output[:, width:].tolist():
            continuations.append(row[: row.index(eos_id)] if eos_id in row else row)
    return continuations


def generate_answers(model, tokenizer, examples: list[dict], pad_id: int, batch_size: int,
                     max_new_tokens: int) -> list[str]:
    ids = generate_ids(model, tokenizer.eos_token_id, examples, pad_id, batch_size, max_new_tokens)
    return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def rouge_l(predictions: list[str], references: list[str]) -> float | None:
    from rouge_score.rouge_scorer import RougeScorer

    if not predictions:
        return None  # --eval_examples 0
    scorer = RougeScorer(["rougeL"], use_stemmer=True)
    scores = [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references)]
    return sum(scores) / len(scores)


def evaluate_adapter(model, *, accelerator, tokenizer, val_loader, rouge_examples: list[dict], pad_id: int,
             batch_size: int, max_new_tokens: int, mode: str = "full", head=None) -> dict:
    """val_loss, val_perplexity (all processes) and rougeL + generations (main process, then shared)."""
    from accelerate.utils import broadcast_object_list

    loss = adapter_validation_loss(model, val_loader, accelerator, mode, head)
    shared = [None, None]
    if accelerator.is_main_process:
        with accelerator.autocast():
            generations = generate_answers(accelerator.unwrap_model(model), tokenizer, rouge_examples, pad_id,
                                           batch_size, max_new_tokens)
        shared = [rouge_l(generations, [e["record"]["output"].strip() for e in rouge_examples]), generations]
    if accelerator.num_processes > 1:
        broadcast_object_list(shared)
    return {"val_loss": loss, "val_perplexity": perplexity(loss), "rougeL": shared[0], "generations": shared[1]}


def samples_markdown(accelerator, model, tokenizer, examples: list[dict], pad_id: int, max_new_tokens: int) -> str:
    """A few prompts with reference and generated answers, as Markdown for TensorBoard's text tab."""
    if not accelerator.is_main_process:
        return ""
    with accelerator.autocast():
        answers = generate_answers(accelerator.unwrap_model(model), tokenizer, examples, pad_id, len(examples),
                                   max_new_tokens)
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
        rows.append({"instruction": record["instruction"], "input": record["input"], "reference": record["output"],
                     "before": before[i] if before else None, "after": after[i] if after else None})
    return rows


def before_after_table(report: dict) -> str:
    lines = [f"{'metric':<16}{'before':>12}{'after':>12}{'change':>12}"]
    for key in ("val_loss", "val_perplexity", "rougeL"):
        b, a = report["before"][key], report["after"][key]
        if b is None or a is None:
            lines.append(f"{key:<16}{'-':>12}{'-':>12}{'-':>12}")
        else:
            lines.append(f"{key:<16}{b:>12.4f}{a:>12.4f}{a - b:>+12.4f}")
    lines.append(f"(validation: {report['val_examples']} examples, ROUGE-L on {report['rouge_examples']}; "
                 f"best adapter at step {report['best_step']} of {report['steps']}"
                 + ("; stopped early)" if report["stopped_early"] else ")"))
    return "\n".join(lines)
