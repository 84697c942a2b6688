"""The layout promised in ARCHITECTURE.md: packages by pipeline stage, no import cycles, thin scripts."""
import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = {"core", "data", "models", "train", "infer", "sweep", "scaling"}
MAX_FUNCTION_LINES = 60  # longer ones must say why in a `# long:` comment


def _modules() -> dict[str, Path]:
    root = REPO / "llmlab"
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
            for p in root.rglob("*.py")}


def _imports(path: Path, package: str) -> set[str]:
    """llmlab modules a module imports, at module level or inside functions: a function-level import still couples
    the two modules, and hides a cycle the module-level graph cannot show."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("llmlab"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("llmlab"))
    return found


def test_every_module_lives_in_a_stage_package():
    flat = [name for name in _modules() if name.count(".") == 1 and name.split(".")[1] not in PACKAGES]
    assert flat == [], f"modules outside the stage packages: {flat}"
    assert {name.split(".")[1] for name in _modules() if name.count(".") >= 1} == PACKAGES


def test_no_import_cycles():
    modules = _modules()
    graph = {name: {m for m in _imports(path, name) if m in modules and m != name and not name.startswith(m + ".")}
             for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_scripts_stay_thin():
    for script in ("train_pretrain.py", "train_lora.py", "sweep.py", "merge_and_infer.py"):
        assert len((REPO / script).read_text().splitlines()) < 60, script


def test_no_function_is_long_without_a_reason():
    long = []
    for name, path in _modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                body = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if length > MAX_FUNCTION_LINES and "# long:" not in body:
                    long.append(f"{name}.{node.name} ({length} lines)")
    assert long == [], f"split these or say why in a `# long:` comment: {long}"
