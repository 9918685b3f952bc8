"""Backend selection rules (deepinfer_kernels._backend) and the no-import-of-triton promise of the dispatchers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from deepinfer_kernels._backend import ENV_VAR, KernelBackendError, resolve_backend, triton_available


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return monkeypatch


def test_auto_on_cpu_is_reference(clean_env: pytest.MonkeyPatch) -> None:
    x = torch.zeros(3)
    assert resolve_backend("op", "auto", x) == "torch"
    clean_env.setenv(ENV_VAR, "auto")
    assert resolve_backend("op", "auto", x) == "torch"


def test_env_torch_forces_reference_but_not_explicit_argument(clean_env: pytest.MonkeyPatch) -> None:
    x = torch.zeros(3)
    clean_env.setenv(ENV_VAR, " Torch ")
    assert resolve_backend("op", "auto", x) == "torch"
    clean_env.setenv("TRITON_INTERPRET", "1")
    if triton_available():
        assert resolve_backend("op", "triton", x) == "triton"  # an explicit argument wins over the env


def test_env_is_read_at_call_time(clean_env: pytest.MonkeyPatch) -> None:
    x = torch.zeros(3)
    clean_env.setenv(ENV_VAR, "bogus")
    with pytest.raises(KernelBackendError, match=f"{ENV_VAR}='bogus'"):
        resolve_backend("op", "auto", x)
    clean_env.setenv(ENV_VAR, "torch")
    assert resolve_backend("op", "auto", x) == "torch"


def test_bad_backend_argument_names_value() -> None:
    with pytest.raises(KernelBackendError, match="my_op: backend='cuda'"):
        resolve_backend("my_op", "cuda", torch.zeros(1))
    with pytest.raises(ValueError):  # KernelBackendError is a ValueError (old callers catch that)
        resolve_backend("my_op", "", torch.zeros(1))


def test_explicit_triton_on_cpu_without_interpreter_raises(clean_env: pytest.MonkeyPatch) -> None:
    if not triton_available():
        pytest.skip("triton not installed")
    with pytest.raises(KernelBackendError, match=r"needs every tensor on CUDA.*\['cpu'\]"):
        resolve_backend("op", "triton", torch.zeros(2))
    clean_env.setenv(ENV_VAR, "triton")  # env=triton acts as an explicit request
    with pytest.raises(KernelBackendError, match="TRITON_INTERPRET"):
        resolve_backend("op", "auto", torch.zeros(2))
    clean_env.setenv("TRITON_INTERPRET", "true")
    assert resolve_backend("op", "auto", torch.zeros(2)) == "triton"


def test_unsupported_inputs(clean_env: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2)
    with pytest.raises(KernelBackendError, match="no kernel for these inputs \\(fp64\\)"):
        resolve_backend("op", "triton", x, triton_ok=False, why_not="fp64")
    clean_env.setenv(ENV_VAR, "triton")
    assert (
        resolve_backend("op", "auto", x, triton_ok=False) == "torch"
    )  # env keeps the reference for such ops


def test_meta_tensors_are_not_cuda(clean_env: pytest.MonkeyPatch) -> None:
    assert resolve_backend("op", "auto", torch.empty(2, device="meta")) == "torch"


def test_dispatchers_reject_triton_where_no_kernel(clean_env: pytest.MonkeyPatch) -> None:
    from deepinfer_kernels.norm_rope import apply_rope

    x = torch.zeros(2, 8, dtype=torch.float64)  # apply_rope has no kernel for float64
    cos = torch.ones(2, 2)
    with pytest.raises(KernelBackendError, match="apply_rope"):
        apply_rope(x, cos, cos * 0, backend="triton")
    clean_env.setenv(ENV_VAR, "triton")
    torch.testing.assert_close(apply_rope(x, cos, cos * 0), x)  # env=triton: reference where no kernel


def _module_level_imports(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text()).body:  # top level only: imports inside functions are lazy
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_dispatchers_import_triton_lazily() -> None:
    """Only the `triton.py` backend files may import triton at module level (no import-time side effects)."""
    src = Path(__file__).resolve().parents[1] / "src" / "deepinfer_kernels"
    files = [p for p in src.rglob("*.py") if p.name != "triton.py"]
    assert len(files) > 15
    offenders = {
        str(p.relative_to(src)): n
        for p in files
        for n in _module_level_imports(p)
        if n == "triton" or n.startswith("triton.") or n.endswith(".triton") or ".triton." in n
    }
    assert offenders == {}
    assert "triton" in _module_level_imports(src / "sparse_attn" / "triton.py")  # the check can see imports


@pytest.mark.gpu
def test_auto_on_cuda_picks_triton(clean_env: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, device="cuda")
    expected = "triton" if triton_available() else "torch"
    assert resolve_backend("op", "auto", x) == expected
    assert resolve_backend("op", "auto", x, torch.zeros(2)) == "torch"  # mixed devices: the reference decides
    clean_env.setenv(ENV_VAR, "torch")
    assert resolve_backend("op", "auto", x) == "torch"


def test_resolved_backends_never_read_the_environment(monkeypatch) -> None:
    import torch
    from deepinfer_kernels import KernelBackendError, backend_from_env
    from deepinfer_kernels._backend import resolve_backend

    x = torch.zeros(2)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for env, resolved in (("", "device"), ("auto", "device"), ("torch", "torch"), ("TRITON", "triton-where-supported")):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", env)
        assert backend_from_env() == resolved
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")  # would force triton under "auto"
    assert resolve_backend("op", "device", x) == "torch"  # CPU tensors: the reference, whatever the variable says
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    assert resolve_backend("op", "triton-where-supported", x, triton_ok=False, why_not="no kernel") == "torch"
    with pytest.raises(KernelBackendError, match="needs every tensor on CUDA"):
        resolve_backend("op", "triton-where-supported", x)  # an op with a kernel: an explicit request (if triton)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "nope")
    with pytest.raises(KernelBackendError, match="DEEPINFER_KERNEL_BACKEND='nope'"):
        backend_from_env()
