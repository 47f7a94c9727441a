"""Import rules (read from the source with `ast`, every import, function-local ones
included): the lower layers never reach up, env and models stay independent, kernels
know no model, and one module owns tool-call rendering."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_LEVEL = ("env", "models", "kernels", "inference", "rl", "configs", "train", "bench")

# package -> top-level packages it must never import
FORBIDDEN = {
    "env": {"rl", "configs", "train", "models"},
    "models": {"rl", "configs", "train", "env"},
    "kernels": {"rl", "configs", "train", "models"},
    "inference": {"rl", "configs", "train"},
}


def _modules(package: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _imports(path: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in the file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def test_the_ast_reader_sees_function_local_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\ndef f():\n    from rl import tracker\n    import models.qwen3\n")
    assert _imports(str(path)) == [(1, "os"), (3, "rl"), (4, "models")]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_never_import_upward(package):
    modules = _modules(package)
    assert modules, package
    bad = [f"{os.path.relpath(path, ROOT)}:{line} imports {name}"
           for path in modules for line, name in _imports(path)
           if name in FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


def test_one_module_owns_tool_call_rendering():
    """models/tokenizer.py (the chat template) defines render_tool_call; no other module
    defines one, and every other use imports it from there."""
    owners, users = [], []
    for package in TOP_LEVEL:
        paths = [os.path.join(ROOT, "train.py")] if package == "train" else _modules(package)
        for path in paths:
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            rel = os.path.relpath(path, ROOT)
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and node.name == "render_tool_call":
                    owners.append(rel)
                if isinstance(node, ast.ImportFrom) and any(
                        a.name == "render_tool_call" for a in node.names):
                    users.append((rel, node.module))
    assert owners == ["models/tokenizer.py"]
    assert all(module == "models.tokenizer" for _, module in users), users


# A config section's owner and what it builds from, private to its package: code outside
# the package reaches them through the package's public entry point.
PRIVATE = {
    "rl/algos": ("rl.algos.base", "rl.algos.grpo_ps", "rl.algos.spo"),  # via rl.algos
    # via env.sandbox (with env.sandbox.base, the interface, and env.sandbox.pool)
    "env/sandbox": tuple(f"env.sandbox.{m}" for m in (
        "factory", "local", "docker", "cluster", "supervisor", "supervisor_main", "shell",
        "fsread", "output")),
    # engines via inference.build
    "inference": ("inference.embedded", "inference.sglang", "inference.launcher"),
}
PRODUCT = ("train.py", "rl", "env", "inference", "models")


def _product_modules() -> list[str]:
    return [os.path.join(ROOT, p) if p.endswith(".py") else m
            for p in PRODUCT for m in ([None] if p.endswith(".py") else _modules(p))]


def _module_names(path: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, `from a import b` giving a.b
    too (b may be a module)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


@pytest.mark.parametrize("package", sorted(PRIVATE))
def test_section_owners_are_reached_through_their_entry_point(package):
    bad = []
    for path in _product_modules():
        rel = os.path.relpath(path, ROOT)
        if rel.startswith(package + "/"):
            continue
        bad += [f"{rel}:{line} imports {name}" for line, name in _module_names(path)
                if name in PRIVATE[package]]
    assert not bad, "\n".join(bad)


def test_the_qwen3_config_is_built_in_one_place():
    """Only models/ reads the presets (models.loading builds a run's Qwen3Config)."""
    bad = []
    for path in _product_modules():
        rel = os.path.relpath(path, ROOT)
        if rel.startswith("models/"):
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        bad += [f"{rel}:{n.lineno}" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and n.attr == "PRESETS"]
    assert not bad, bad


def _local_imports_without_reason(path: str) -> list[int]:
    """Lines of imports inside a function with no comment on the line or on a line of
    the comment/import block just above it."""
    with open(path) as f:
        source = f.read()
    lines = source.splitlines()
    out = []
    for fn in ast.walk(ast.parse(source, path)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            i = node.lineno - 1
            block = [lines[i]]
            while i > 0 and lines[i - 1].strip().startswith(("#", "from ", "import ")) \
                    or i > 0 and not lines[i - 1].strip() and lines[i - 2].strip().startswith(
                        ("from ", "import ")):
                i -= 1
                block.append(lines[i])
            if not any("#" in line for line in block):
                out.append(node.lineno)
    return out


def test_the_import_reader_wants_a_reason_for_a_local_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import json\n\n\ndef g():\n    # optional: x\n"
                    "    import yaml\n\n    from a import b\n\n\ndef h():\n"
                    "    import zlib  # (why)\n")
    assert _local_imports_without_reason(str(path)) == [2]


def test_imports_inside_functions_say_why():
    bad = [f"{os.path.relpath(path, ROOT)}:{line}" for path in _product_modules()
           for line in _local_imports_without_reason(path)]
    assert not bad, "imports inside a function need a comment saying why:\n" + "\n".join(bad)
