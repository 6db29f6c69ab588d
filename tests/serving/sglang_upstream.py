"""TEST CODE: what the SGLang 0.5.23 wheel's source defines, read with `ast` from the wheel file (sglang is
never imported or installed). The contract tests compare the project's SGLang backend with it.

Where the wheel comes from: `make sglang-wheel` downloads it (`pip download --no-deps`) into
.cache/wheels/, and `make test`, `make test-fast` and `make test-loaded` export SGLANG_WHEEL=<that directory>.
Without SGLANG_WHEEL (pytest run by hand) the default directory is read. A missing wheel is an error either
way: the contract tests fail with the command that fetches it.
"""

from __future__ import annotations

import ast
import os
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

VERSION = "0.5.23"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / ".cache" / "wheels"
FETCH = "make sglang-wheel"


def wheel_path() -> Path:
    """The 0.5.23 wheel; pytest.fail, naming the command that fetches it, when it is missing."""
    given = os.environ.get("SGLANG_WHEEL")
    where = Path(given) if given else DEFAULT_DIR
    found = sorted(where.glob(f"sglang-{VERSION}-*.whl")) if where.is_dir() else ([where] if where.is_file() else [])
    if found:
        return found[0]
    if given:
        pytest.fail(f"SGLANG_WHEEL={given} holds no sglang-{VERSION} wheel; `{FETCH}` downloads it", pytrace=False)
    pytest.fail(f"no sglang-{VERSION} wheel in {where}: `{FETCH}` downloads it (make test fetches it)", pytrace=False)


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _keys(node) -> set[str]:
    """String keys written anywhere in `node`: dict literals, x["key"] = ..., x.update(key=...)."""
    keys = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Dict):
            keys |= {k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                key = t.slice if isinstance(t, ast.Subscript) else None
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    keys.add(key.value)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update":
            keys |= {k.arg for k in n.keywords if k.arg}
    return keys


@dataclass(frozen=True)
class ServerArg:
    name: str  # the dataclass field
    flags: frozenset  # its CLI spellings
    is_bool: bool


class Upstream:
    """The parts of the 0.5.23 source the contract tests need, parsed on first use."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self._zip = zipfile.ZipFile(wheel)

    def pinned(self, requirement: str) -> str:
        """The exact version the wheel's METADATA pins a dependency to (Requires-Dist: name==version)."""
        meta = next(n for n in self._zip.namelist() if n.endswith(".dist-info/METADATA"))
        for line in self._zip.read(meta).decode().splitlines():
            if line.startswith(f"Requires-Dist: {requirement}=="):
                return line.split("==", 1)[1].split(";")[0].strip()
        raise LookupError(f"the wheel's METADATA pins no exact {requirement} version")

    def source(self, module_path: str) -> str:
        return self._zip.read(f"sglang/{module_path}").decode()

    def tree(self, module_path: str) -> ast.Module:
        return ast.parse(self.source(module_path))

    def function(self, module_path: str, name: str, cls: str | None = None) -> ast.AST:
        scope = self.tree(module_path)
        if cls is not None:
            scope = next(n for n in ast.walk(scope) if isinstance(n, ast.ClassDef) and n.name == cls)
        for n in ast.walk(scope):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                return n
        raise LookupError(f"{module_path}: no function {name}")

    @cached_property
    def routes(self) -> dict[str, set[str]]:
        """HTTP path -> methods, from the FastAPI decorators of srt/entrypoints/http_server.py."""
        found: dict[str, set[str]] = {}
        for fn in ast.walk(self.tree("srt/entrypoints/http_server.py")):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for d in fn.decorator_list:
                if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args):
                    continue
                path = _literal(d.args[0])
                if not isinstance(path, str) or not path.startswith("/"):
                    continue
                if d.func.attr == "api_route":
                    methods = next((_literal(k.value) for k in d.keywords if k.arg == "methods"), ["GET"])
                elif d.func.attr in ("get", "post", "put", "delete"):
                    methods = [d.func.attr.upper()]
                else:
                    continue
                found.setdefault(path, set()).update(methods)
        return found

    def handler(self, path: str) -> ast.AST:
        for fn in ast.walk(self.tree("srt/entrypoints/http_server.py")):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(d, ast.Call) and d.args and _literal(d.args[0]) == path for d in fn.decorator_list):
                return fn
        raise LookupError(f"no handler for {path}")

    def _classes(self, module_path: str) -> dict[str, ast.ClassDef]:
        return {n.name: n for n in self.tree(module_path).body if isinstance(n, ast.ClassDef)}

    def struct_fields(self, name: str, module_path: str = "srt/managers/io_struct.py") -> dict[str, ast.AST]:
        """Annotated fields of a class in `module_path`, its bases in the same module included."""
        classes = self._classes(module_path)
        cls, fields = classes[name], {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                fields.update(self.struct_fields(base.id, module_path))
        for n in cls.body:
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                fields[n.target.id] = n.annotation
        return fields

    def literal_choices(self, struct: str, field: str) -> set:
        """The values of a Literal[...] field annotation."""
        ann = self.struct_fields(struct)[field]
        lits = [n for n in ast.walk(ann) if isinstance(n, ast.Subscript) and getattr(n.value, "id", "") == "Literal"]
        return {e.value for lit in lits for e in ast.walk(lit.slice) if isinstance(e, ast.Constant)}

    @cached_property
    def api_sampling_fields(self) -> tuple[str, ...]:
        """The sampling_params keys /generate's JSON contract admits (it rejects any other)."""
        for n in self.tree("api/v1/api_types.py").body:
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_FIELDS_SamplingParams":
                return tuple(_literal(n.value))
        raise LookupError("api_types: no _FIELDS_SamplingParams")

    @cached_property
    def meta_info_keys(self) -> set[str]:
        """Keys the tokenizer manager (and the weight-version spans) write into a response's meta_info and
        into the output dicts around it."""
        return _keys(self.tree("srt/managers/tokenizer_manager.py")) | _keys(self.tree("srt/utils/weight_versions.py"))

    @cached_property
    def finish_reasons(self) -> dict[str, set[str]]:
        """type -> keys of every FINISH_* reason's to_json()."""
        out: dict[str, set[str]] = {}
        for cls in self._classes("srt/managers/schedule_batch.py").values():
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "to_json":
                    for d in (n for n in ast.walk(fn) if isinstance(n, ast.Dict)):
                        kv = {_literal(k): v for k, v in zip(d.keys, d.values) if k is not None}
                        if isinstance(kv.get("type"), ast.Constant):
                            out.setdefault(kv["type"].value, set()).update(kv)
        return out

    @cached_property
    def server_args(self) -> dict[str, ServerArg]:
        """CLI flag -> ServerArg, from the A[type, "help" | Arg(...)] fields of srt/arg_groups/fields/*.py."""
        found: dict[str, ServerArg] = {}
        for name in self._zip.namelist():
            if not (name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py")):
                continue
            for n in ast.walk(ast.parse(self._zip.read(name).decode())):
                if not (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                        and isinstance(n.annotation, ast.Subscript) and getattr(n.annotation.value, "id", "") == "A"):
                    continue
                typ, meta = n.annotation.slice.elts[:2]
                kw = {k.arg: _literal(k.value) for k in meta.keywords} if isinstance(meta, ast.Call) else {}
                if kw.get("no_cli"):
                    continue
                flags = {kw.get("cli_name") or "--" + n.target.id.replace("_", "-"), *(kw.get("aliases") or ())}
                is_bool = ast.unparse(typ) in ("bool", "Optional[bool]")
                arg = ServerArg(n.target.id, frozenset(flags), is_bool)
                found.update({f: arg for f in flags})
        return found

    def field_default(self, field: str, module: str = "srt/arg_groups/fields/serving.py"):
        for n in ast.walk(self.tree(module)):
            if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == field:
                return _literal(n.value)
        raise LookupError(f"{module}: no field {field}")

    @cached_property
    def payload_loader(self) -> ast.ClassDef:
        """The class of srt/utils/common.py that restricts what an update payload may name: the one with an
        ALLOWED_GLOBALS allow-list and a find_class of its own (its source read, never run)."""
        for cls in self._classes("srt/utils/common.py").values():
            names = {getattr(n.targets[0], "id", "") for n in cls.body if isinstance(n, ast.Assign)}
            methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            if "ALLOWED_GLOBALS" in names and "find_class" in methods:
                return cls
        raise LookupError("srt/utils/common.py: no class with ALLOWED_GLOBALS and find_class")

    @cached_property
    def unpickle_allowed(self) -> set[tuple[str, str]]:
        """The payload loader's ALLOWED_GLOBALS: the (module, name) pairs an update payload may name."""
        for n in self.payload_loader.body:
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "ALLOWED_GLOBALS":
                return set(_literal(n.value))
        raise LookupError(f"{self.payload_loader.name}.ALLOWED_GLOBALS")

    @cached_property
    def unpickle_redirected(self) -> set[tuple[str, str]]:
        """(module, name) pairs the payload loader's find_class maps to a function of its own before the
        allow-list."""
        fn = self.function("srt/utils/common.py", "find_class", cls=self.payload_loader.name)
        return {_literal(c.comparators[0]) for c in ast.walk(fn)
                if isinstance(c, ast.Compare) and isinstance(c.ops[0], ast.Eq) and isinstance(c.left, ast.Tuple)}
