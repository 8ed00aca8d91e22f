"""Shared fixtures. ``bundles`` exports the runtime's test bundles once per session, lazily."""
from __future__ import annotations

import pytest

from helpers import Bundles


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> Bundles:
    return Bundles(tmp_path_factory.mktemp("bundles"))
