"""The import graph has floors: each package imports only what sits below it or beside it as allowed.

    adaptive_eagle_cli        the program: mounts every package's commands, and the demo
    loop                      the composition: stack, its config and check, candidate hand-off, `up`
    serving  trainer          peers: they meet only through the store and the head registry
    policies                  the promotion policy: pure decisions (serving calls its canary)
    feature_store             the store of captured traffic
    adaptive_eagle            the core: engine, head, checkpoints, registry

Function-level imports count, and so do constant names given to importlib.import_module / __import__.
bench/, ops/ and tests/ sit outside the packages and no package imports them."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = {"bench", "ops", "tests"}
PACKAGES = ("adaptive_eagle", "feature_store", "policies", "trainer", "serving", "loop", "adaptive_eagle_cli")
# package -> top-level packages it must not import
FORBIDDEN = {
    "adaptive_eagle": {"feature_store", "policies", "trainer", "serving", "loop", "adaptive_eagle_cli"},
    "feature_store": {"policies", "trainer", "serving", "loop", "adaptive_eagle_cli"},
    "policies": {"feature_store", "trainer", "serving", "loop", "adaptive_eagle_cli"},
    "trainer": {"policies", "serving", "loop", "adaptive_eagle_cli"},
    "serving": {"trainer", "loop", "adaptive_eagle_cli"},
    "loop": {"adaptive_eagle_cli"},
    "adaptive_eagle_cli": set(),
}
MODULES = [(pkg, p) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


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


def test_every_top_level_package_has_a_floor():
    found = {p.parent.name for p in ROOT.glob("*/__init__.py")} - OUTSIDE
    assert found == set(PACKAGES), f"packages without a rule here: {sorted(found - set(PACKAGES))}"


def test_the_scan_sees_every_package():
    seen = {pkg for pkg, _ in MODULES}
    assert seen == set(PACKAGES)
    assert {p.name for pkg, p in MODULES if pkg == "loop"} >= {"stack.py", "config.py", "check.py", "candidates.py"}


def test_the_scan_catches_an_upward_import():
    src = "def f():\n    from trainer.train_head import run_eval_head\n    import importlib\n" \
          "    importlib.import_module('serving.app')\n"
    assert {n.split(".")[0] for n in imported_names(ast.parse(src))} >= {"trainer", "serving"}


@pytest.mark.parametrize("pkg,path", MODULES, ids=lambda v: v if isinstance(v, str) else str(v.relative_to(ROOT)))
def test_module_imports_nothing_above_or_beside_it(pkg, path):
    tops = {n.split(".")[0] for n in imported_names(ast.parse(path.read_text(), str(path)))}
    bad = sorted(tops & (FORBIDDEN[pkg] | OUTSIDE))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: {pkg} must not import {sorted(FORBIDDEN[pkg])}"
