"""The layering rule of the Python package, checked on the source by parsing its imports.

    core (dflash_llama.*) -> reference / converter -> train / parity / bench -> CLI

A module may import from a lower layer, or from its own package; never upward, never sideways
into another package of its layer, and never a private (`_`-prefixed) name of another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it becomes (pyproject.toml's wheel.packages)
PACKAGES = {"python/dflash_llama": "dflash_llama", "reference": "dflash_llama.reference",
            "converter": "dflash_llama.converter", "train": "dflash_llama.train",
            "parity": "dflash_llama.parity", "bench": "dflash_llama.bench"}
LAYERS = {"dflash_llama": 0, "dflash_llama.reference": 1, "dflash_llama.converter": 1,
          "dflash_llama.train": 2, "dflash_llama.parity": 2, "dflash_llama.bench": 2}
CLI_MODULES = {"dflash_llama.cli", "dflash_llama.run_cli", "dflash_llama.generate_cli", "dflash_llama.cli_args"}
CLI_LAYER = 3
CLI_SHARED = {"dflash_llama.cli_args"}  # the flags every subcommand shares: any CLI module may import it
ALLOWED_PRIVATE = {"_core"}  # the compiled extension module


def package_of(module: str) -> str:
    """The package whose layer a module takes: the longest known package that contains it."""
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def layer_of(module: str) -> int:
    if module in CLI_MODULES or module.endswith(".cli"):
        return CLI_LAYER
    return LAYERS[package_of(module)]


def modules(root: Path, packages: dict[str, str]):
    """(dotted name, is_package, path) of every Python file of the package folders."""
    for folder, dotted in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("").parts
            is_pkg = rel[-1] == "__init__"
            parts = rel[:-1] if is_pkg else rel
            yield ".".join((dotted, *parts)), is_pkg, path


def imports(module: str, is_pkg: bool, path: Path):
    """(line, imported module, imported names) for every dflash_llama import of a file."""
    here = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dflash_llama"):
                    yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("dflash_llama"):
                yield node.lineno, target, [a.name for a in node.names]


def violations(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> list[str]:
    known = {m for m, _, _ in modules(root, packages)}
    found = []
    for module, is_pkg, path in modules(root, packages):
        where = f"{path.relative_to(root)}"
        for line, target, names in imports(module, is_pkg, path):
            # `from pkg import mod` imports the module pkg.mod
            targets = [f"{target}.{n}" if f"{target}.{n}" in known else target for n in names] or [target]
            for t in targets:
                same_package = package_of(t) == package_of(module) and layer_of(t) <= layer_of(module)
                shared_cli = t in CLI_SHARED and layer_of(module) == CLI_LAYER
                if not (same_package or shared_cli or layer_of(t) < layer_of(module)):
                    found.append(f"{where}:{line}: {module} (layer {layer_of(module)}) imports {t} "
                                 f"(layer {layer_of(t)})")
            for n in names:
                if n.startswith("_") and n not in ALLOWED_PRIVATE and n != "__version__":
                    found.append(f"{where}:{line}: {module} imports the private name {n} from {target}")
    return found


def test_imports_follow_the_layers():
    assert violations() == []


def test_a_planted_violation_is_found(tmp_path):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "python/dflash_llama/paths.py").write_text("from .bench import runner\n")
    (tmp_path / "reference/model.py").write_text("from dflash_llama.converter.target import _read\n")
    (tmp_path / "bench/runner.py").write_text("from dflash_llama.parity import stages\n")
    (tmp_path / "parity/stages.py").write_text("from ..reference import model\n")
    found = violations(tmp_path)
    assert found == [
        "python/dflash_llama/paths.py:1: dflash_llama.paths (layer 0) imports dflash_llama.bench.runner (layer 2)",
        "reference/model.py:1: dflash_llama.reference.model (layer 1) imports dflash_llama.converter.target (layer 1)",
        "reference/model.py:1: dflash_llama.reference.model imports the private name _read from "
        "dflash_llama.converter.target",
        "bench/runner.py:1: dflash_llama.bench.runner (layer 2) imports dflash_llama.parity.stages (layer 2)",
    ]


@pytest.mark.parametrize("module,layer", [("dflash_llama.paths", 0), ("dflash_llama.reference.model", 1),
                                          ("dflash_llama.train.trainer", 2), ("dflash_llama.bench.cli", 3),
                                          ("dflash_llama.run_cli", 3), ("dflash_llama.cli_args", 3)])
def test_layer_of(module, layer):
    assert layer_of(module) == layer
