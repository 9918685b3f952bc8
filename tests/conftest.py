"""Shared fixtures of the cross-package tests."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def script() -> Iterator[Callable[[str], ModuleType]]:
    """Loads `scripts/<name>.py` as a module (registered under its name, with the scripts folder importable, as the
    scripts import each other); both are undone after the test module."""
    names: list[str] = []
    sys.path.insert(0, str(SCRIPTS))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        names.append(name)
        spec.loader.exec_module(mod)
        return mod

    yield load
    for name in names:
        sys.modules.pop(name, None)
    sys.path.remove(str(SCRIPTS))
