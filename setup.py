"""Package discovery: every folder with an ``__init__.py`` under the four top-level folders is a
package of the wheel (``modeling/int8`` -> ``mbert.modeling.int8``), so a new subpackage cannot be
left out. The rest of the metadata is in pyproject.toml."""
from setuptools import find_packages, setup

ROOTS = ("modeling", "bundle", "export", "runtime")  # folder -> package mbert.<folder>

setup(
    packages=[f"mbert.{p}" for p in find_packages(include=[f"{r}" for r in ROOTS] + [f"{r}.*" for r in ROOTS])],
    package_dir={f"mbert.{r}": r for r in ROOTS},
)
