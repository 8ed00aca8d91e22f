"""Shared fixtures. ``bundles`` exports the runtime's test bundles once per session, lazily;
``rtx_export`` runs ``mbert-export --fp16 --engine tensorrt-rtx`` once per session (trt_helpers.py)."""
from __future__ import annotations

import pytest
from helpers import Bundles


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> Bundles:
    return Bundles(tmp_path_factory.mktemp("bundles"))


@pytest.fixture(scope="session")
def rtx_export(tmp_path_factory):
    """(process, checkpoint, bundle) of the command-line export with a real TensorRT-RTX engine."""
    from trt_helpers import export_rtx_bundle

    return export_rtx_bundle(tmp_path_factory.mktemp("rtx"))
