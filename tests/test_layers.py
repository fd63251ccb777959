"""The package layers point one way: cg_jax.kernels <- models <- the runtime (cg_jax) <- front ends.

`models` imports nothing of cg_jax (it is handed its attention implementation), the kernels
import neither models nor the runtime, and no import inside a function crosses the packages
(the way a cycle is hidden).
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources(package: str):
  for directory, _, files in os.walk(os.path.join(ROOT, package)):
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        yield os.path.relpath(path, ROOT), ast.parse(open(path).read(), path)


def _imports(tree):
  """(module imported, line, inside a function) for each import statement."""
  inner = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      inner.update(id(n) for n in ast.walk(node) if n is not node)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names = [node.module]
    else:
      continue
    for name in names:
      yield name, node.lineno, id(node) in inner


def _package(module: str) -> str:
  parts = module.split(".")
  if parts[:2] == ["cg_jax", "kernels"]:
    return "kernels"
  return parts[0]


def test_import_models_loads_no_cg_jax_module():
  code = "import sys, models; print(sorted(m for m in sys.modules if m.split('.')[0] == 'cg_jax'))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       check=True).stdout.strip()
  assert out == "[]", out


@pytest.mark.parametrize("package, forbidden", [
    ("models", {"cg_jax", "kernels"}),
    ("cg_jax/kernels", {"cg_jax", "models"}),
])
def test_lower_layers_import_no_higher_one(package, forbidden):
  bad = [f"{path}:{line} imports {module}" for path, tree in _sources(package)
         for module, line, _ in _imports(tree) if _package(module) in forbidden]
  assert not bad, bad


def test_no_function_level_import_crosses_packages():
  bad = []
  for package in ("cg_jax", "models"):
    for path, tree in _sources(package):
      own = "kernels" if path.startswith(os.path.join("cg_jax", "kernels")) else package
      for module, line, inside in _imports(tree):
        if inside and _package(module) in {"cg_jax", "models", "kernels"} - {own}:
          bad.append(f"{path}:{line} imports {module} inside a function")
  assert not bad, bad
