"""The architecture, checked as import-linter contracts (``.importlinter`` at the repository root), and
each contract shown to fail on the import that would break it.

The contracts: the layers (export > runtime > modeling > bundle), serving never imports the exporter,
no import cycle between modules (siblings acyclic at every depth of every package), and the bundle
contract and the runtime (but its eager reference) never import torch. Every folder with Python
modules is a package of the wheel (setup.py discovers them).
"""
from __future__ import annotations

import ast
import copy
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from importlinter.application.use_cases import read_user_options
from importlinter.configuration import configure
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"
CONTRACT_TYPES = {"layers": LayersContract, "forbidden": ForbiddenContract, "acyclic_siblings": AcyclicSiblingsContract}


@pytest.fixture(scope="module")
def setup():
    configure()
    options = read_user_options(str(CONFIG))
    graph = grimp.build_graph(*options.session_options["root_packages"], include_external_packages=True)
    contracts = {c["id"]: c for c in options.contracts_options}
    return options, graph, contracts


def check(setup, contract_id: str, *extra_imports: tuple[str, str]) -> bool:
    """Whether contract ``contract_id`` is kept on the real import graph plus ``extra_imports``."""
    options, graph, contracts = setup
    graph = copy.deepcopy(graph)
    for importer, imported in extra_imports:
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")
    raw = contracts[contract_id]
    contract = CONTRACT_TYPES[raw["type"]](name=raw["name"], session_options=options.session_options,
                                           contract_options=raw)
    return contract.check(graph, verbose=False).kept


def test_lint_imports_keeps_every_contract():
    lint_imports = Path(sys.executable).parent / "lint-imports"  # the console script of this environment
    done = subprocess.run([str(lint_imports), str(CONFIG), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 kept, 0 broken" in done.stdout, done.stdout


@pytest.mark.parametrize("contract_id, breaking", [
    ("layers", [("mbert.bundle.manifest", "mbert.runtime.encoder")]),  # the contract reaching up
    ("layers", [("mbert.modeling.model", "mbert.export.pipeline")]),
    ("serving-never-imports-the-exporter", [("mbert.runtime.encoder", "mbert.export.pipeline")]),
    ("serving-never-imports-the-exporter", [("mbert.bundle.validation", "mbert.export.progress")]),
    ("no-cycles", [("mbert.bundle.tensors", "mbert.bundle.manifest")]),  # manifest imports tensors
    ("no-cycles", [("mbert.export.onnx.lowering", "mbert.export.onnx.trace")]),  # trace imports lowering
    ("no-cycles", [("mbert.runtime.backends.checks", "mbert.runtime.backends.tensorrt")]),
    ("torch-free-serving", [("mbert.runtime.text", "torch")]),
    ("torch-free-serving", [("mbert.bundle.files", "mbert.modeling.graph")]),  # torch through the model
    ("torch-free-serving", [("mbert.runtime.backends.onnxruntime", "mbert.runtime.eager")]),  # not an allowed edge
])
def test_each_contract_fails_on_the_import_that_breaks_it(setup, contract_id, breaking):
    assert check(setup, contract_id), f"{contract_id} is broken on the code as it is"
    assert not check(setup, contract_id, *breaking), f"{contract_id} kept despite {breaking}"


def test_every_folder_of_modules_is_a_discovered_package():
    """A subpackage without ``__init__.py`` would be left out of the wheel: every folder holding Python
    modules under the four roots has one, and setup.py's discovery lists exactly those folders."""
    sys.path.insert(0, str(ROOT))
    try:
        tree = ast.parse((ROOT / "setup.py").read_text())
    finally:
        sys.path.remove(str(ROOT))
    roots = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ROOTS")
    from setuptools import find_packages

    found = set(find_packages(str(ROOT), include=[f"{r}" for r in roots] + [f"{r}.*" for r in roots]))
    folders = {str(p.parent.relative_to(ROOT)).replace("/", ".") for r in roots for p in (ROOT / r).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders == found, f"folders of modules without __init__.py: {sorted(folders - found)}"
