"""train_lora.py end to end on the tiny GPT-2 and small pydoc subsets, plus the adapter plumbing in-process."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import kill_when_ready, run_in_process, run_script

# Small enough for two CPU cores shared with other work; lr is high so 12 steps visibly move the loss.
TINY_RUN = [
    "--max_examples",
    "160",
    "--max_length",
    "64",
    "--batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--warmup_steps",
    "2",
    "--eval_every",
    "4",
    "--log_every",
    "3",
    "--eval_batch_size",
    "16",
    "--eval_examples",
    "4",
    "--max_new_tokens",
    "6",
    "--num_samples",
    "2",
]


def _lora(args, tiny_gpt2_dir, cache, out):
    result = run_in_process(
        [
            "train_lora.py",
            "--base_model",
            str(tiny_gpt2_dir),
            "--cache_dir",
            str(cache),
            "--output_dir",
            str(out),
            *TINY_RUN,
            *args,
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads((out / "eval.json").read_text())


@pytest.mark.slow
def test_tiny_run_lowers_validation_loss_and_writes_a_small_adapter(
    tiny_gpt2_dir, gpt2_tokenizer, pydoc_cache_dir, tmp_path
):
    out = tmp_path / "run"
    result, report = _lora(
        ["--learning_rate", "1e-2", "--max_steps", "12", "--sample_every", "6"], tiny_gpt2_dir, pydoc_cache_dir, out
    )
    before, after = report["before"]["validation"], report["after"]["validation"]
    for split in ("validation", "test"):
        for key in ("loss", "perplexity", "rougeL"):
            assert isinstance(report["before"][split][key], float) and isinstance(report["after"][split][key], float)
    assert after["loss"] < before["loss"] - 0.02 and after["perplexity"] < before["perplexity"]
    test_change = report["change"]["test"]["perplexity"]  # a paired bootstrap CI over the test examples
    assert test_change["ci"][0] <= test_change["change"] <= test_change["ci"][1] < 0
    assert test_change["change"] == pytest.approx(
        report["after"]["test"]["perplexity"] - report["before"]["test"]["perplexity"], rel=1e-4
    )
    assert (
        12 <= report["test_examples"] <= 16 and report["val_examples"] + report["train_examples"] <= 144
    )  # 160 records, 10 % test; over-long prompts dropped
    assert report["steps"] == 12 and report["best_step"] > 0 and not report["stopped_early"]
    assert len(report["examples"]) == 4 and all(isinstance(r["after"], str) for r in report["examples"])
    assert "test perplexity" in result.stdout and "rougeL" in result.stdout and "95 % CI" in result.stdout
    # the default r=16 on every linear layer of 2 blocks of width 64: 2 * 16 * ((64+192) + (64+64) + 2 * (64+256))
    assert "32,768 trainable" in result.stdout and "['c_attn', 'c_fc', 'c_proj']" in result.stdout

    # The adapter: peft files, LoRA weights only, a tiny fraction of the base model.
    from safetensors.torch import load_file

    adapter = out / "adapter"
    weights = load_file(adapter / "adapter_model.safetensors")
    assert weights and all("lora_" in name for name in weights)
    assert sum(t.numel() for t in weights.values()) == report["trainable_params"] == 32768
    base_bytes = (tiny_gpt2_dir / "model.safetensors").stat().st_size
    assert (adapter / "adapter_model.safetensors").stat().st_size < 0.01 * base_bytes
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["lora_alpha"] == 32 and config["lora_dropout"] == 0.1
    assert {name.rsplit(".", 1)[-1] for name in config["target_modules"]} == {"c_attn", "c_proj", "c_fc"}
    assert not any("lm_head" in name for name in config["target_modules"])
    assert json.loads((adapter / "llmlab_prompt.json").read_text())["eos_after_answer"] is True
    assert not (adapter / "tokenizer_config.json").exists()  # the base model's own tokenizer: not duplicated

    # The adapter on disk is the one evaluated "after": base + saved adapter reproduces that validation loss.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmlab.data.instruct import collate, load_records, split_three, tokenize_records
    from llmlab.train.lora.config import LoraTrainConfig
    from llmlab.train.lora.evaluation import answer_logits

    defaults = LoraTrainConfig()
    tokenizer = gpt2_tokenizer
    _, val, test = split_three(load_records("builtin:pydoc", pydoc_cache_dir), 0.1, 0.1, defaults.data_seed, 160)
    assert not {r["instruction"] for r in test} & {r["instruction"] for r in val}
    val_examples, _ = tokenize_records(tokenizer, val, 64, defaults.prompt_template, defaults.prompt_template_no_input)
    assert len(val_examples) == report["val_examples"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir), adapter).eval()
    batch = collate(val_examples, tokenizer.eos_token_id)
    with torch.no_grad():
        logits, targets, _ = answer_logits(model, batch, "full")
    reloaded = torch.nn.functional.cross_entropy(logits, targets)
    assert float(reloaded) == pytest.approx(after["loss"], abs=1e-4)

    # Run folder: config, run info, metrics as in pretraining, sample generations in TensorBoard text.
    assert (out / "config.yaml").is_file() and (out / "run_info.json").is_file()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*metrics)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "val/loss", "val/perplexity"} <= keys
    logged = {k: v for m in metrics for k, v in m.items() if k.startswith("eval/")}
    assert logged["eval/test_rougeL_before"] == report["before"]["test"]["rougeL"]
    assert logged["eval/validation_perplexity_after"] == after["perplexity"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "samples/text_summary" in events.Tags()["tensors"]
    samples = events.Tensors("samples/text_summary")
    assert [s.step for s in samples] == [6, 12]
    assert "**reference:**" in samples[0].tensor_proto.string_val[0].decode()


@pytest.mark.slow
def test_early_stopping_on_a_stalled_run_keeps_the_best_adapter(tiny_gpt2_dir, pydoc_cache_dir, tmp_path):
    out = tmp_path / "stalled"
    # Also exercises adaptive clipping, label smoothing and gradient checkpointing through the CLI.
    result, report = _lora(
        [
            "--learning_rate",
            "0",
            "--eval_every",
            "1",
            "--patience",
            "2",
            "--max_steps",
            "30",
            "--eval_examples",
            "2",
            "--sample_every",
            "100",
            "--clip",
            "adaptive",
            "--label_smoothing",
            "0.1",
            "--gradient_checkpointing",
        ],
        tiny_gpt2_dir,
        pydoc_cache_dir,
        out,
    )
    assert report["stopped_early"] is True
    assert report["steps"] == 2  # step 0 is the baseline; evaluations at steps 1 and 2 did not improve
    assert report["best_step"] == 0
    assert report["after"]["validation"]["loss"] == pytest.approx(report["before"]["validation"]["loss"], abs=1e-6)
    assert "early stop at step 2" in result.stdout
    val_losses = [
        m["val/loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val/loss" in m
    ]
    assert len(val_losses) == 3 and len(set(val_losses)) == 1  # the base model (step 0), steps 1 and 2


def _per_step(out, key):
    """The last logged value per step (a resumed run logs the steps after its checkpoint again)."""
    values = {}
    for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        if key in rec:
            values[rec["step"]] = rec[key]
    return values


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(tiny_gpt2_dir, pydoc_cache_dir, tmp_path):
    # 112 examples: 10 optimizer steps per epoch, so the 16 steps cross an epoch boundary after the resume point (8).
    args = [
        "train_lora.py",
        "--base_model",
        str(tiny_gpt2_dir),
        "--cache_dir",
        str(pydoc_cache_dir),
        *TINY_RUN,
        "--max_examples",
        "112",
        "--learning_rate",
        "1e-2",
        "--max_steps",
        "16",
        "--log_every",
        "2",
        "--save_every",
        "4",
        "--sample_every",
        "100",
    ]
    reference = tmp_path / "reference"
    done = run_script([*args, "--output_dir", str(reference)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "killed"
    kill_when_ready([*args, "--output_dir", str(out)], out / "checkpoints" / "step_8")
    assert not (out / "eval.json").exists(), "the run finished before it was killed; nothing was tested"
    # Adapter-only checkpoints: the frozen base is rebuilt from --base_model, not copied into each one.
    base_bytes = (tiny_gpt2_dir / "model.safetensors").stat().st_size
    checkpoints = list((out / "checkpoints").glob("step_*"))
    assert checkpoints and all(sum(f.stat().st_size for f in c.rglob("*")) < 0.2 * base_bytes for c in checkpoints)

    resumed = run_script([*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "evaluating the base model" not in resumed.stdout
    for key in ("train/loss", "train/lr", "train/grad_norm", "val/loss"):
        want, got = _per_step(reference, key), _per_step(out, key)
        assert sorted(got) == sorted(want), key
        assert got == pytest.approx(want, rel=1e-5), key
    want, got = (json.loads((run / "eval.json").read_text()) for run in (reference, out))
    assert got["best_step"] == want["best_step"] and got["steps"] == want["steps"] == 16
    assert got["before"] == want["before"]
    assert got["after"]["validation"]["loss"] == pytest.approx(want["after"]["validation"]["loss"], rel=1e-5)
    assert len(list((out / "checkpoints").glob("step_*"))) == 2  # --keep_last default

    # A checkpoint from another setup is refused before anything is loaded.
    other = run_in_process([*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest", "--batch_size", "2"])
    assert other.returncode == 2 and "resume with the same" in other.stderr and "Traceback" not in other.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_run_on_gpu_with_bf16(tiny_gpt2_dir, pydoc_cache_dir, tmp_path):
    out = tmp_path / "gpu"
    result = run_script(
        [
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            "1",
            "--mixed_precision",
            "bf16",
            "train_lora.py",
            "--base_model",
            str(tiny_gpt2_dir),
            "--cache_dir",
            str(pydoc_cache_dir),
            "--output_dir",
            str(out),
            *TINY_RUN,
            "--learning_rate",
            "1e-2",
            "--max_steps",
            "12",
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on cuda" in result.stdout
    report = json.loads((out / "eval.json").read_text())
    assert report["after"]["validation"]["loss"] < report["before"]["validation"]["loss"]


def test_missing_default_base_model_is_a_one_line_error(repo_root, tmp_path):
    # Run from an empty folder: runs/pretrain/final is relative to the working directory.
    result = run_script([str(repo_root / "train_lora.py")], cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "runs/pretrain/final" in lines[0] and "accelerate launch train_pretrain.py" in lines[0]
    assert "--base_model" in lines[0]


def test_bad_options_are_one_line_errors(tmp_path):
    result = run_script(["train_lora.py", "--prompt_template", "no placeholders", "--base_model", "x"])
    assert result.returncode == 2 and "{instruction}" in result.stderr and "Traceback" not in result.stderr
    result = run_script(["train_lora.py", "--base_model", str(tmp_path / "nope"), "--output_dir", str(tmp_path)])
    assert result.returncode == 2 and "cannot load --base_model" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_script(["train_lora.py", "--keep_last", "0", "--base_model", "x"])
    assert result.returncode == 2 and "--keep_last must be >= 1" in result.stderr
    result = run_script(["train_lora.py", "--save_every", "-1", "--base_model", "x"])
    assert result.returncode == 2 and "--save_every must be >= 0" in result.stderr
    result = run_script(
        [
            "train_lora.py",
            "--base_model",
            str(tmp_path),
            "--output_dir",
            str(tmp_path / "run"),
            "--resume_from_checkpoint",
            "latest",
        ]
    )
    assert result.returncode == 2 and "no checkpoint in" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------------------
# In-process: adapter placement, gradient checkpointing, trimmed logits, batched generation
# ---------------------------------------------------------------------------------------------------------


def _tiny_cfg(tiny_gpt2_dir, **overrides):
    from llmlab.train.lora.config import LoraTrainConfig

    return LoraTrainConfig(base_model=str(tiny_gpt2_dir), **overrides)


def _batch(tokenizer):
    from llmlab.data.instruct import collate, format_prompt, tokenize_example

    records = [
        {"instruction": "What does `len` do?", "input": "len(obj, /)", "output": "Return the number of items."},
        {"instruction": "Say hi", "input": "", "output": "hi there, friend"},
    ]
    examples = [tokenize_example(tokenizer, format_prompt(r), r["output"], 64) for r in records]
    return examples, collate(examples, tokenizer.eos_token_id)


def test_only_adapter_weights_train_and_checkpointing_reaches_them(tiny_gpt2_dir, gpt2_tokenizer):
    from llmlab.train.lora.model import add_lora, load_base_model
    from llmlab.train.loss import causal_lm_loss

    torch.manual_seed(0)
    cfg = _tiny_cfg(tiny_gpt2_dir, gradient_checkpointing=True)
    model, _, from_base = load_base_model(cfg)
    assert from_base  # the fixture saved its tokenizer with the model
    model = add_lora(model, cfg)
    trainable, total = model.get_nb_trainable_parameters()
    assert trainable == 32768 and total > 100 * trainable  # r=16 on every linear layer of the 2 blocks
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert model.get_base_model().is_gradient_checkpointing
    model.train()
    _, batch = _batch(gpt2_tokenizer)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    causal_lm_loss(logits, batch["labels"]).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert grads and all(g is not None for g in grads.values())
    # B starts at zero, so only B gets a non-zero gradient on the first step -- through checkpointed blocks.
    assert all(float(g.abs().sum()) > 0 for n, g in grads.items() if "lora_B" in n)


def test_target_modules_follow_the_model_type():
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmlab.train.lora.config import LoraTrainConfig
    from llmlab.train.lora.model import add_lora

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    model = add_lora(llama, LoraTrainConfig(target_modules=None))  # None: peft's choice for the model type
    assert model.peft_config["default"].target_modules == {"q_proj", "v_proj"}
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}
    llama2 = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    model2 = add_lora(llama2, LoraTrainConfig(target_modules=["o_proj"]))
    assert model2.peft_config["default"].target_modules == {"o_proj"}
    from llmlab.core.errors import UserError

    every_linear = add_lora(LlamaForCausalLM(llama2.config), LoraTrainConfig())  # the default: all-linear
    assert {n.rsplit(".", 1)[-1] for n in every_linear.peft_config["default"].target_modules} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    with pytest.raises(UserError, match="--target_modules"):
        add_lora(LlamaForCausalLM(llama2.config), LoraTrainConfig(target_modules=["no_such_layer"]))


@pytest.mark.filterwarnings("ignore::UserWarning")  # peft's notes on tied weights / Conv1D for the adapted head
def test_answer_only_logits_give_the_same_loss(tiny_gpt2_dir, gpt2_tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmlab.train.lora.evaluation import answer_logits, answer_loss, pick_logits_mode
    from llmlab.train.loss import causal_lm_loss

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir).eval()
    _, batch = _batch(gpt2_tokenizer)
    assert pick_logits_mode(model, batch) == "gather"
    with torch.no_grad():
        reference = causal_lm_loss(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
            batch["labels"],
            label_smoothing=0.1,
        )
        n_answer_tokens = int((batch["labels"] != -100).sum())
        for mode in ("full", "trim", "gather"):
            logits, targets, rows = answer_logits(model, batch, mode, model.get_output_embeddings())
            assert logits.shape[0] == n_answer_tokens == len(targets) == len(rows), mode
            assert torch.allclose(answer_loss(logits, targets, 0.1), reference, atol=1e-5), mode
    # An adapted output layer must stay inside the model's forward: no gathering then.
    adapted_head = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir), LoraConfig(r=2, target_modules=["c_attn", "lm_head"])
    )
    assert pick_logits_mode(adapted_head.get_base_model(), batch) == "trim"


def test_batched_left_padded_generation_matches_one_by_one(tiny_gpt2_dir, gpt2_tokenizer):
    from transformers import AutoModelForCausalLM

    from llmlab.train.lora.evaluation import generate_ids, rouge_scores

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    examples, _ = _batch(gpt2_tokenizer)
    assert examples[0]["prompt_length"] != examples[1]["prompt_length"]  # so one row is left-padded
    eos = gpt2_tokenizer.eos_token_id
    batched = generate_ids(model, eos, examples, eos, batch_size=2, max_new_tokens=12)
    single = [generate_ids(model, eos, [e], eos, batch_size=1, max_new_tokens=12)[0] for e in examples]
    assert batched == single and all(len(ids) == 12 for ids in single)
    assert rouge_scores(["Return the number of items"], ["Return the number of items."]) == [pytest.approx(1.0)]
    assert rouge_scores(["completely different"], ["Return the number of items."]) == [0.0]
