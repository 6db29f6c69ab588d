"""The core imports nothing from the packages built on it (trainer, feature_store, serving,
policies) nor from the program that composes them (adaptive_eagle_cli)."""

import ast
from pathlib import Path

import pytest

import adaptive_eagle

ABOVE = {"trainer", "feature_store", "serving", "policies", "adaptive_eagle_cli"}
MODULES = sorted(Path(adaptive_eagle.__file__).parent.rglob("*.py"))


def imported_names(tree: ast.AST) -> set[str]:
    """Absolute module names imported anywhere in a module (function-level imports included), plus
    constant names given to importlib.import_module / __import__."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def test_the_scan_sees_the_whole_core():
    assert {p.name for p in MODULES} >= {"cli.py", "checkpoint.py", "engine.py", "draft_head.py"}


def test_the_scan_catches_an_upward_import():
    src = "def f():\n    from trainer.train_head import run_eval_head\n    import importlib\n" \
          "    importlib.import_module('serving.app')\n"
    assert {n.split(".")[0] for n in imported_names(ast.parse(src))} >= {"trainer", "serving"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_imports_nothing_from_above(path):
    upward = sorted(n for n in imported_names(ast.parse(path.read_text(), str(path))) if n.split(".")[0] in ABOVE)
    assert not upward, f"{path.name} imports {upward}: the core must not import the packages built on it"
