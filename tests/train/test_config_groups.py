"""The trainers' config groups: a trainer gives its own defaults without redeclaring a group's options, and a
component gets its group as an object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from llmlab.core.config import parse_config
from llmlab.train.config import CheckpointGroup, LoggingGroup, RunGroup, group_defaults
from llmlab.train.lora.config import LoraTrainConfig
from llmlab.train.pretrain.config import PretrainConfig


def field(cls, name):
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def test_a_trainer_sets_group_defaults_keeping_type_help_and_place():
    @dataclass
    @group_defaults(keep_last=7, save_every=(3, "every 3"))
    class Trainer(RunGroup, CheckpointGroup, LoggingGroup):
        extra: int = 1

    cfg = parse_config(Trainer, ["--log_every", "4"])
    assert (cfg.keep_last, cfg.save_every, cfg.log_every) == (7, 3, 4)
    assert field(Trainer, "keep_last").metadata["help"] == field(CheckpointGroup, "keep_last").metadata["help"]
    assert field(Trainer, "save_every").metadata["help"] == "every 3"
    assert [f.name for f in dataclasses.fields(Trainer)][-1] == "extra"  # group options stay in their group's place
    with pytest.raises(TypeError, match="not an inherited option"):
        group_defaults(no_such_option=1)(type("Bad", (CheckpointGroup,), {}))


def test_each_trainer_has_its_own_defaults_and_its_groups_as_objects():
    lora, pretrain = LoraTrainConfig(), PretrainConfig()
    assert (lora.save_every, lora.keep_last, lora.output_dir) == (100, 2, "runs/lora")
    assert (pretrain.save_every, pretrain.keep_last, pretrain.output_dir) == (500, 3, "runs/pretrain")
    assert CheckpointGroup.of(lora) == CheckpointGroup(save_every=100, keep_last=2)
    assert LoggingGroup.of(pretrain) == LoggingGroup(log_every=pretrain.log_every)
