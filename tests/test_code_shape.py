"""Functions fit a screen: none in product code (train.py, configs/, rl/, inference/,
env/, models/, kernels/) longer than 60 lines, and none with more than 6 parameters
(self and cls not counted, `*args` and `**kwargs` one each) unless a comment on its
signature says why, as the traced arrays of a jitted call or the refs of a Pallas
kernel in pallas_call's order; at most 12 such."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES, MAX_PARAMS, MAX_EXCUSED = 60, 6, 12


def _paths() -> list[str]:
    out = [os.path.join(ROOT, "train.py")]
    for package in ("configs", "rl", "inference", "env", "models", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _functions(source: str):
    """(qualified name, lines, parameters, the comments on its signature) of every
    function."""
    lines = source.splitlines()

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                n = (len(params) - bool(params and params[0].arg in ("self", "cls"))
                     + bool(a.vararg) + bool(a.kwarg))
                body = child.body[0].lineno - 1  # the signature: def .. first body line
                signature = lines[child.lineno - 1:max(body, child.lineno)]
                reason = " ".join(line.split("#", 1)[1].strip() for line in signature
                                  if "#" in line)
                yield (f"{prefix}{child.name}", child.end_lineno - child.lineno + 1, n, reason)
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    return list(visit(ast.parse(source), ""))


def _says_why(reason: str) -> bool:
    """A reason names what the parameters are, not only how many there are ("(8: ...")
    or which lint is off ("noqa: ...")."""
    reason = re.sub(r"noqa(:\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*)?", "", reason).strip()
    return bool(re.search(r"[a-z]{3}", reason)) and not re.match(r"\W*\d", reason)


def test_the_reader_measures_lines_parameters_and_reasons():
    source = ("class A:\n    def f(self, a, b, c, d, e, g, h):\n        pass\n\n"
              "def g(a, b, c, d, e, f, h):  # (why)\n    return 1\n\n"
              "def h(a, b, c, d, *args, **kwargs):\n    return 1\n")
    assert _functions(source) == [("A.f", 2, 7, ""), ("g", 2, 7, "(why)"), ("h", 2, 6, "")]
    assert _says_why("(refs in pallas_call's order)")
    assert not _says_why("(8: two owners, the learner's three parts)")
    assert not _says_why("") and not _says_why("noqa")


def _all_functions():
    for path in _paths():
        with open(path) as f:
            rel = os.path.relpath(path, ROOT)
            for name, n_lines, n_params, reason in _functions(f.read()):
                yield f"{rel}:{name}", n_lines, n_params, reason


def test_functions_fit_a_screen():
    long = {name for name, n_lines, _, _ in _all_functions() if n_lines > MAX_LINES}
    assert long == set(), f"over {MAX_LINES} lines: split them"


def test_long_parameter_lists_say_why_and_are_few():
    over = {name: reason for name, _, n_params, reason in _all_functions()
            if n_params > MAX_PARAMS}
    unexplained = {name for name, reason in over.items() if not _says_why(reason)}
    assert unexplained == set(), (f"over {MAX_PARAMS} parameters without a comment on the "
                                  "signature saying why: take an owner or a dataclass")
    assert len(over) <= MAX_EXCUSED, f"{len(over)} functions over {MAX_PARAMS} parameters"
