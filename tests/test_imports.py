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
    path.write_text("import os\ndef f():\n    from rl import spo\n    import models.qwen3\n")
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
