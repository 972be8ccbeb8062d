"""The package's import structure: layers that only import downwards, no import cycles,
and an HTTP side that never loads torch, a model or a kernel.

Every import counts, also one inside a function: a late import that dodges a cycle at
start-up is still a cycle in the design.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import tokenmill

SRC = pathlib.Path(tokenmill.__file__).parent
# Lowest first; a module may import its own layer and those below it.
LAYERS = [
    {"errors", "sampling_params", "config", "options", "quantization_names",
     "model_source", "model_hub", "resident_memory"},
    {"structured"},
    {"core"},
    {"hardware", "kernels", "models"},
    {"engine"},
    {"tokenizer", "metrics"},
    {"frontend"},
    {"server"},
    {"ray_serve", "bench"},
    {"cli"},
]
# What the HTTP process imports (``tokenmill serve``, ``--ray``'s launcher, the CLI).
HTTP_SIDE = ["tokenmill.cli", "tokenmill.server.run", "tokenmill.server.app",
             "tokenmill.engine.process", "tokenmill.ray_serve.options", "tokenmill.bench.cli"]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("tokenmill.")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name}
            for name, path in modules.items()}


def layer(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else None
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def test_every_package_has_a_layer() -> None:
    unplaced = sorted(m for m in graph() if m != "tokenmill" and layer(m) is None)
    assert not unplaced, f"place these in LAYERS: {unplaced}"


def test_imports_only_run_downwards() -> None:
    upward = [f"{m} -> {d}" for m, deps in graph().items() for d in deps
              if m != "tokenmill" and layer(d) > layer(m)]
    assert not upward, "imports running back up:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    edges = graph()
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(
                path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for dep in sorted(edges[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(edges):
        visit(module)


def test_the_http_side_imports_no_torch() -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in HTTP_SIDE) +
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'safetensors', 'ray') or m.startswith("
            "('tokenmill.models', 'tokenmill.kernels', 'tokenmill.engine.builder')))\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
