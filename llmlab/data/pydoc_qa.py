"""builtin:pydoc -- an offline instruction set from the installed Python standard library's docstrings.

"What does `json.dumps` do?" (input: its signature) -> the docstring's first paragraph. Real text only,
de-duplicated, deterministic for a given Python build, built once into an atomically written JSONL cache.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable

from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_text

PYDOC_BUILDER_VERSION = 2

# Stdlib modules whose import prints, opens windows/browsers, starts REPLs, needs a display, or is
# scaffolding rather than a library. Private modules (leading underscore) are skipped by rule.
PYDOC_SKIP = {
    "antigravity",
    "this",
    "turtle",
    "turtledemo",
    "tkinter",
    "idlelib",
    "lib2to3",
    "ensurepip",
    "venv",
    "pydoc_data",
    "test",
    "readline",
    "rlcompleter",
    "distutils",
    "encodings",
    "msilib",
    "winreg",
    "winsound",
    "msvcrt",
    "nt",
    "asynchat",
    "asyncore",
    "imp",
    "smtpd",
    "crypt",
    "nis",
    "spwd",
    "ossaudiodev",
    "sre_compile",
    "sre_constants",
    "sre_parse",
    "xxsubtype",
    "xxlimited",
    "xxlimited_35",
    "sitecustomize",
    "usercustomize",
}
MIN_ANSWER_CHARS, MAX_ANSWER_CHARS = 20, 600
# Where people meet these names: `os.stat`, not `posix.stat`; `len`, not `builtins.len`.
PYDOC_IMPLEMENTED_IN = {"os": ("posix",)}
PYDOC_DISPLAY_NAME = {"posixpath": "os.path", "builtins": ""}


def _looks_like_signature(paragraph: str, name: str) -> bool:
    text = paragraph.strip()
    first_word = text.split()[0]
    return text.startswith(f"{name}(") or ("(" in first_word and (text.endswith(")") or "->" in text.splitlines()[0]))


def _first_paragraph(doc: str | None, name: str) -> str | None:
    """The docstring's first prose paragraph, reflowed to one line; None if there is no real text."""
    if not doc or not isinstance(doc, str):
        return None
    paragraphs = [p for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]
    # C functions and namedtuples often open with a signature line such as "dumps(obj, ...)" -- not prose.
    while paragraphs and _looks_like_signature(paragraphs[0], name):
        paragraphs.pop(0)
    if not paragraphs:
        return None
    text = " ".join(line.strip() for line in paragraphs[0].splitlines()).strip()
    if not (MIN_ANSWER_CHARS <= len(text) <= MAX_ANSWER_CHARS) or not any(c.isalpha() for c in text):
        return None
    if text.startswith(("Initialize self.", "Create and return a new object.", "Return repr(self).")):
        return None  # object's generic slot docstrings, inherited by countless C classes
    return text


class _Shown:
    """A default value shown by a fixed text in a signature."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown_default(value: Any) -> Any:
    """Literal defaults as written; anything else as `...`: a default such as `environ=os.environ` must
    not copy this machine's environment (or paths) into the dataset."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (str, bytes)) and len(value) <= 40 and not value.startswith(("/", b"/")):
        return value
    if isinstance(value, tuple) and len(value) <= 4 and all(_shown_default(v) is v for v in value):
        return value
    return _Shown("...")


def _signature(qualname: str, obj: Any) -> str:
    try:
        signature = inspect.signature(obj)
        params = [
            p if p.default is p.empty else p.replace(default=_shown_default(p.default))
            for p in signature.parameters.values()
        ]
        return f"{qualname}{signature.replace(parameters=params)}"
    except Exception:  # C text signatures can name unresolvable defaults (AttributeError, NameError, ...)
        return ""  # many C builtins have no introspectable signature: the input stays empty


def _public_modules(names: Iterable[str]) -> list[str]:
    """Top-level stdlib modules plus their public submodules, private and skipped ones removed, sorted."""
    found = []
    for top in sorted(names):
        if top.startswith("_") or top in PYDOC_SKIP:
            continue
        try:
            module = importlib.import_module(top)
        except Exception:  # platform-specific modules (winreg, ...) or missing optional C libs
            continue
        found.append(top)
        for info in pkgutil.walk_packages(
            getattr(module, "__path__", []) or [], prefix=f"{top}.", onerror=lambda _name: None
        ):
            parts = info.name.split(".")
            if any(p.startswith("_") or p in ("test", "tests") for p in parts[1:]):
                continue
            found.append(info.name)
    return found


def build_pydoc_records(module_names: Iterable[str] | None = None) -> list[dict[str, str]]:
    """Pairs "What does `json.dumps` do?" -> first docstring paragraph, for public stdlib callables.

    Deterministic for a given Python build: modules and members are visited in sorted order, and
    duplicates (the same object re-exported, or the same answer text under several names) keep the
    first occurrence, so a paragraph never sits in both the train and the validation split.
    """
    collector = _Collector()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in _public_modules(sys.stdlib_module_names if module_names is None else module_names):
            try:
                module = importlib.import_module(modname)
            except Exception:
                continue
            collector.visit_module(modname, module)
    return collector.records


class _Collector:
    """Walks modules and classes in sorted order, keeping the first occurrence of every object and answer."""

    def __init__(self):
        self.records: list[dict[str, str]] = []
        self.seen_objects: set[int] = set()
        self.seen_answers: set[str] = set()

    def add(self, qualname: str, obj: Any, kind: str) -> None:
        short = qualname.rsplit(".", 1)[-1]
        answer = _first_paragraph(getattr(obj, "__doc__", None), short)
        if answer is None or answer in self.seen_answers:
            return
        self.seen_answers.add(answer)
        instruction = {
            "module": f"What is the `{qualname}` module for?",
            "class": f"What is the `{qualname}` class for?",
        }.get(kind, f"What does `{qualname}` do?")
        self.records.append(
            {
                "instruction": instruction,
                "input": "" if kind == "module" else _signature(qualname, obj),
                "output": answer,
            }
        )

    def visit_module(self, modname: str, module: Any) -> None:
        shown = PYDOC_DISPLAY_NAME.get(modname, modname)
        prefix = f"{shown}." if shown else ""
        if shown:
            self.add(shown, module, "module")
        public = getattr(module, "__all__", None)
        for attr in sorted(set(public) if isinstance(public, (list, tuple)) else dir(module)):
            if attr.startswith("_"):
                continue
            try:
                obj = getattr(module, attr)
            except Exception:
                continue
            # Only what this module defines (or its C accelerator: `_json` for `json`), or what a
            # package re-exports from its own submodules in __all__ (`json.JSONDecoder`, not
            # `json.decoder.JSONDecoder`); never things it merely imports from elsewhere.
            home = getattr(obj, "__module__", None) or ""
            own = home in (modname, f"_{modname}", *PYDOC_IMPLEMENTED_IN.get(modname, ()))
            reexported = isinstance(public, (list, tuple)) and home.startswith(f"{modname}.")
            if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not (own or reexported):
                continue
            if id(obj) in self.seen_objects:
                continue
            self.seen_objects.add(id(obj))
            if inspect.isclass(obj):
                self.visit_class(f"{prefix}{attr}", obj)
            else:
                self.add(f"{prefix}{attr}", obj, "function")

    def visit_class(self, qualname: str, cls: Any) -> None:
        self.add(qualname, cls, "class")
        for method_name in sorted(vars(cls)):
            if method_name.startswith("_"):
                continue
            method = vars(cls)[method_name]
            if isinstance(method, (staticmethod, classmethod)):
                method = method.__func__
            if inspect.isroutine(method) and id(method) not in self.seen_objects:
                self.seen_objects.add(id(method))
                self.add(f"{qualname}.{method_name}", method, "function")


def pydoc_cache_path(cache_dir: str | os.PathLike) -> Path:
    """Keyed by the exact Python build (docstrings differ between versions) and the builder version."""
    key = hashlib.sha256(f"{sys.version}|{PYDOC_BUILDER_VERSION}".encode()).hexdigest()[:12]
    return Path(cache_dir) / f"pydoc-{sys.version_info.major}.{sys.version_info.minor}-{key}.jsonl"


def load_pydoc(cache_dir: str | os.PathLike) -> list[dict[str, str]]:
    """The builtin:pydoc records, built once into an atomically written JSONL cache.

    Building imports ~250 stdlib modules; that runs in a child interpreter so whatever they print or
    register at import time (signal handlers, atexit hooks, warnings) never touches this process.
    """
    path = pydoc_cache_path(cache_dir)
    if not path.is_file():
        env = {**os.environ, "DISPLAY": "", "WAYLAND_DISPLAY": "", "BROWSER": "true"}
        proc = subprocess.run(
            [sys.executable, "-m", "llmlab.data.pydoc_qa", "--build-pydoc", str(path)],
            capture_output=True,
            text=True,
            env=env,
            stdin=subprocess.DEVNULL,
            cwd=str(Path(__file__).resolve().parents[2]),
            timeout=600,
        )
        if proc.returncode != 0 or not path.is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"building builtin:pydoc failed ({tail[:200]}); pass a JSONL file to --dataset instead")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_pydoc_cache(path: str) -> None:
    records = build_pydoc_records()
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


if __name__ == "__main__":
    # Child-process entry used by load_pydoc: `python -m llmlab.data.pydoc_qa --build-pydoc OUT.jsonl`.
    if len(sys.argv) == 3 and sys.argv[1] == "--build-pydoc":
        _write_pydoc_cache(sys.argv[2])
    else:
        sys.exit("usage: python -m llmlab.data.pydoc_qa --build-pydoc OUT.jsonl")
