"""Typed run configs: a dataclass per script, every field settable from YAML and the command line.

Precedence: dataclass default < `--config file.yaml` < command-line flag. Help text lives in
`field(metadata={"help": ...})`, so `--help` documents every option in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from llmlab.core.errors import UserError

T = TypeVar("T")


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "aim": "aim", "comet_ml": "comet_ml"}


def check_report_to(report_to: list[str]) -> list[str]:
    """The tracker names to use; unknown or missing ones are one-line errors naming the fix. The names are
    accelerate's trackers (`TRACKERS`), plus any a plugin registered with accelerate's `register_tracker_class`."""
    # a plugin registers its tracker by importing accelerate.tracking; when nothing has, none is registered, and
    # the check need not load torch
    tracking = sys.modules.get("accelerate.tracking")
    registry = tracking.LOGGER_TYPE_TO_CLASS if tracking else {}
    registered = [n for n, kind in registry.items() if kind.__module__ != "accelerate.tracking"]
    choices = (*TRACKERS, *registered, "all", "none")
    names = list(dict.fromkeys(report_to or ["none"]))
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise UserError(f"--report_to {unknown[0]!r} is unknown; choose from {', '.join(choices)}")
    if "none" in names:
        if len(names) > 1:
            raise UserError("--report_to none cannot be combined with other trackers")
        return []
    if "all" in names:
        return [n for n, package in TRACKERS.items() if importlib.util.find_spec(package)] + registered
    missing = [n for n in names if n in TRACKERS and not importlib.util.find_spec(TRACKERS[n])]
    if missing:
        raise UserError(
            f"--report_to {missing[0]}: the {TRACKERS[missing[0]]} package is not installed; "
            f"pip install {TRACKERS[missing[0]]}, or drop it from --report_to"
        )
    return names


def opt(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with a help line; `opt([...], ...)` works for mutable defaults too. `choices=` a registry
    (a mapping whose keys are the names) is read when a config is parsed, so an entry registered later is a choice.
    `outcome=False` marks an option that changes no result (where and how work runs, what is reported): a sweep
    resumes across a change of it."""
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata={"help": help, **kwargs})
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _converter(tp: Any, name: str, registry: Any = None):
    """A function turning a CLI string or a YAML value into the field's type, or raising UserError."""
    tp, optional = _unwrap_optional(tp)

    def convert(value: Any) -> Any:
        if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
            return None
        if registry is not None or get_origin(tp) is Literal:
            choices = list(registry) if registry is not None else get_args(tp)
            if value not in choices:
                raise UserError(f"--{name}: {value!r} is not one of {', '.join(map(str, choices))}")
            return value
        if get_origin(tp) is list:
            (inner,) = get_args(tp)
            items = value if isinstance(value, list) else [v for v in str(value).replace(",", " ").split()]
            return [_converter(inner, name)(v) for v in items]
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise UserError(f"--{name}: expected true/false, got {value!r}")
        if tp in (int, float, str):
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise UserError(f"--{name}: expected an integer, got {value!r}")
            try:
                number = (
                    tp(float(value)) if tp is int and isinstance(value, str) and "e" in value.lower() else tp(value)
                )
            except (TypeError, ValueError, OverflowError):
                raise UserError(f"--{name}: expected {tp.__name__}, got {value!r}") from None
            if tp is float and not math.isfinite(number):  # nan/inf would train, and save, garbage
                raise UserError(f"--{name}: expected a finite number, got {value!r}")
            return number
        return value

    return convert


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one `--name` flag per dataclass field, plus `--config`."""
    hints = _field_types(cls)
    parser.add_argument("--config", default=None, help="YAML file with any of these options (flags override it)")
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f.metadata.get("help", "")
        help_text = f"{help_text} (default: {default})" if help_text else f"(default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if tp is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if get_origin(tp) is list:
            kwargs["nargs"] = "+"
        elif f.metadata.get("choices") is not None:
            kwargs["choices"] = list(f.metadata["choices"])
        elif get_origin(tp) is Literal:
            kwargs["choices"] = list(get_args(tp))
        parser.add_argument(f"--{f.name}", metavar=f.metadata.get("metavar", f.name.upper()), **kwargs)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} not found; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"config file {path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of option: value")
    return data


def build_config(cls: type[T], values: dict[str, Any], source: str = "config") -> T:
    """Make a `cls` from a dict, converting and validating every value; unknown keys are errors."""
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise UserError(f"unknown option(s) {', '.join(unknown)} in {source}; see --help for valid names")
    registries = {f.name: f.metadata.get("choices") for f in dataclasses.fields(cls)}
    converted = {k: _converter(hints[k], k, registries[k])(v) for k, v in values.items()}
    cfg = cls(**converted)
    if callable(getattr(cfg, "resolved", None)):  # checked, with derived defaults: a new config, nothing mutated
        return cfg.resolved()
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def config_from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """Merge YAML (if --config) and explicitly given flags into a validated `cls`."""
    values: dict[str, Any] = {}
    config_path = getattr(ns, "config", None)
    if config_path:
        values.update(load_yaml(config_path))
    names = {f.name for f in dataclasses.fields(cls)}
    values.update({k: v for k, v in vars(ns).items() if k in names})
    return build_config(cls, values, source=str(config_path or "flags"))


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, like every other bad input (the usage is in --help)."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}; see {self.prog} --help")


def parse_config(cls: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """One-call CLI: build the parser for `cls`, parse argv, return the resolved config."""
    parser = Parser(description=description)
    add_dataclass_args(parser, cls)
    # The deepspeed launcher appends --local_rank=N; accept and ignore it (accelerate reads LOCAL_RANK).
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    return config_from_namespace(cls, ns)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
