"""Cross-package checks: layering contracts, lint, and that each package stands on its declared dependencies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["deepinfer-kernels", "deepinfer-parallel", "deepinfer-dspark", "deepinfer-engine", "deepseek-recipe"]


def _tool(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed in this environment (it is in the workspace dev group)")
    return found


def test_import_layering_contracts_hold() -> None:
    proc = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_is_clean() -> None:
    proc = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("package", PACKAGES)
def test_package_metadata(package: str) -> None:
    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    assert meta["name"] == package
    assert meta["version"] == "0.1.0"
    assert (ROOT / "packages" / package / "README.md").is_file()
    assert (ROOT / "packages" / package / "src" / package.replace("-", "_") / "__init__.py").is_file()
    internal = [d for d in meta.get("dependencies", []) if d.split(">")[0].split("=")[0].strip() in PACKAGES]
    for dep in internal:  # ranges that treat a 0.x minor bump as breaking, never exact pins
        assert ">=0.1" in dep and "<0.2" in dep, dep
    if package == "deepseek-recipe":
        assert not any(d.startswith("torch") for d in meta.get("dependencies", []))
        assert internal == []


def test_uv_lock_is_committed() -> None:
    assert (ROOT / "uv.lock").is_file()


@pytest.mark.slow
def test_recipe_installs_and_tests_alone(tmp_path: Path) -> None:
    """`uv pip install ./packages/deepseek-recipe` into a fresh venv pulls no torch and no other member, and the
    recipe's own suite (golden replay included) passes there with only pytest + hypothesis added."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    subprocess.run([uv, "venv", "-q", str(venv)], check=True, env=env)
    py = venv / "bin" / "python"
    proc = subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(py), str(ROOT / "packages" / "deepseek-recipe")],
        capture_output=True, text=True, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    listed = subprocess.run([uv, "pip", "list", "--python", str(py)], capture_output=True, text=True, env=env).stdout
    names = {line.split()[0].lower() for line in listed.splitlines()[2:] if line.strip()}
    assert "torch" not in names
    assert not names & {"deepinfer-kernels", "deepinfer-engine", "deepinfer-parallel", "deepinfer-dspark"}
    proc = subprocess.run([str(py), "-c", "import deepseek_recipe, sys; assert 'torch' not in sys.modules"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(py), "pytest>=8.3", "hypothesis>=6.100"],
        capture_output=True, text=True, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "packages/deepseek-recipe"],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
