"""Where a pretraining run reads its config: every read of an option, followed through the calls of one tiny run.

Each read of a PretrainConfig field (or of a config group a component was handed) is recorded with the llmlab module
and line that made it. Printed: the places (distinct module:line), the modules, and the returns: how often the
sequence of reads comes back to a module it had left. Run it in any checkout (`--repo` another tree, e.g. an older
commit's `git archive`) to compare two versions of the code on the same run.

    python bench/config_reads.py
    python bench/config_reads.py --repo /tmp/before
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1], help="the tree to measure")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of the tiny run")
    return parser.parse_args(argv)


def trace(classes: list[type], fields: set[str], reads: list[tuple[str, int]]) -> None:
    """Record (module, line) of every read of `fields` on instances of `classes`, made from llmlab code."""
    for cls in classes:
        original = cls.__getattribute__

        def getattribute(self, name, original=original):
            if name in fields:
                frame = sys._getframe(1)
                module = frame.f_globals.get("__name__", "")
                if module.startswith("llmlab."):
                    reads.append((module, frame.f_lineno))
            return original(self, name)

        cls.__getattribute__ = getattribute


def summary(reads: list[tuple[str, int]]) -> dict:
    modules, returns, seen, last = [], 0, set(), None
    for module, _ in reads:
        if module != last:
            returns += module in seen
            seen.add(module)
            last = module
        modules.append(module)
    return {"reads": len(reads), "places": len(set(reads)), "modules": len(seen), "returns": returns}


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(args.repo))
    from llmlab.core.config import parse_config
    from llmlab.train.pretrain import config as pretrain_config
    from llmlab.train.pretrain.loop import train

    PretrainConfig = pretrain_config.PretrainConfig
    fields = {f.name for f in dataclasses.fields(PretrainConfig)}
    groups = [cls for cls in vars(sys.modules["llmlab.train.config"]).values() if isinstance(cls, type)]
    classes = [PretrainConfig, *[c for c in groups if dataclasses.is_dataclass(c) and c.__name__.endswith("Group")]]
    with tempfile.TemporaryDirectory() as tmp:
        options = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32, "batch_size": 2}
        options |= {"effective_batch_size": 2, "max_documents": 5, "eval_batches": 2, "max_steps": args.steps}
        options |= {"log_every": 2, "eval_every": 2, "save_every": 2, "output_dir": f"{tmp}/run", "report_to": "none"}
        options |= {"cache_dir": f"{tmp}/cache"}
        argv = [arg for name, value in options.items() for arg in (f"--{name}", str(value))]
        cfg = parse_config(PretrainConfig, argv)
        reads: list[tuple[str, int]] = []
        trace(classes, fields, reads)
        train(cfg)
    result = {"repo": str(args.repo), **summary(reads)}
    by_module: dict[str, int] = {}
    for module, _ in set(reads):
        by_module[module] = by_module.get(module, 0) + 1
    result["places_by_module"] = dict(sorted(by_module.items(), key=lambda kv: -kv[1]))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
