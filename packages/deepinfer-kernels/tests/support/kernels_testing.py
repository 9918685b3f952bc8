"""Test helpers for kernel suites (importlib mode forbids test-to-test imports): the Triton CPU interpreter switch.

Imports nothing beyond the standard library at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType

__all__ = ["LINEAR_MODULES", "sm90_compile_report", "triton_interpreter"]


# the linear backend with the kernel modules it imports, in import order: each re-imported under the interpreter (a
# compiled epilogue called from an interpreted kernel fails) and restored afterwards
LINEAR_MODULES = ("deepinfer_kernels.wgmma_frag.triton", "deepinfer_kernels.linear.split_k.triton",
                  "deepinfer_kernels.linear.fp8_frag.triton", "deepinfer_kernels.linear.triton")


@contextlib.contextmanager
def triton_interpreter(*module_names: str) -> Iterator[list[ModuleType]]:
    """Import the named Triton backend modules afresh with TRITON_INTERPRET=1 and yield them.

    triton.jit reads TRITON_INTERPRET (triton.knobs.runtime.interpret) when the decorator runs, i.e. when the
    backend module is imported, and then returns either a compiled JITFunction or an InterpretedFunction. So the
    variable must be set before the import, and a module imported earlier without it (a GPU test in the same
    process) must be re-imported. The same holds for triton's own jit-decorated library functions (`tl.zeros`,
    `tl.max`, ... in triton.language.standard, decorated when triton is first imported): if triton was imported
    without the interpreter (e.g. by `torch._dynamo`), its Python modules are imported afresh too (the C
    extension `triton._C` is kept). On exit the environment variable, `sys.modules` entries and the parent
    package attributes are restored (so `from pkg import triton` in a dispatcher sees the original again).
    """
    saved_env = os.environ.get("TRITON_INTERPRET")
    saved = {name: sys.modules.get(name) for name in module_names}
    saved_triton: dict[str, ModuleType] = {}
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        standard = sys.modules.get("triton.language.standard")
        if standard is not None and type(standard.zeros).__name__ != "InterpretedFunction":
            saved_triton = {
                k: m
                for k, m in sys.modules.items()
                if (k == "triton" or k.startswith("triton.")) and not k.startswith("triton._C")
            }
            for k in saved_triton:
                del sys.modules[k]
        for name in module_names:
            sys.modules.pop(name, None)
        yield [importlib.import_module(name) for name in module_names]
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        if saved_triton:
            for k in [
                k
                for k in sys.modules
                if (k == "triton" or k.startswith("triton.")) and not k.startswith("triton._C")
            ]:
                del sys.modules[k]
            sys.modules.update(saved_triton)
        for name, module in saved.items():
            parent_name, _, child = name.rpartition(".")
            parent = sys.modules.get(parent_name)
            if module is None:
                sys.modules.pop(name, None)
                if parent is not None and hasattr(parent, child):
                    delattr(parent, child)
            else:
                sys.modules[name] = module
                if parent is not None:
                    setattr(parent, child, module)


def cuobjdump(compiled: object, flag: str) -> str:
    """The text `cuobjdump FLAG` ("-sass", "--dump-resource-usage") prints for a compiled kernel's cubin, with the
    cuobjdump that ships in the triton wheel."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])  # type: ignore[attr-defined]
        return subprocess.run(
            [os.path.join(bin_dir, "cuobjdump"), flag, path], capture_output=True, text=True, check=True
        ).stdout


def sass_loops(sass: str) -> list[list[str]]:
    """The instructions of every loop in a SASS listing: a backward branch closes a loop, whose body is every
    instruction from the branch target to the branch."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    out = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            out.append([t for a, t in ins if int(m.group(1), 16) <= a <= addr])
    return out


def sm90_compile_report(
    kernel: object,
    signature: dict[str, str],
    constexprs: dict[str, object],
    *,
    num_warps: int,
    num_stages: int = 2,
    divisible_by_16: tuple[str, ...] = (),
) -> dict[str, object]:
    """Compile a (non-interpreted) @triton.jit kernel ahead of time for sm_90a on a machine without a GPU and
    return its resource use read back from the cubin with the cuobjdump that ships in the triton wheel:
    {"regs", "stack" (spill bytes), "shared_static", "shared" (triton's dynamic smem), "wgmma", "mma",
    "cp_async" (some load was pipelined into asynchronous copies)}.

    signature: {arg name: triton type string ("*bf16", "i32", "fp32", ...)} for the runtime arguments;
    constexprs: {name: value} (one with a declared default may be left out); divisible_by_16: runtime arguments to
    compile as the JIT specialises pointers and integers that are multiples of 16 (it decides the vector width of
    loads, hence whether a gather becomes asynchronous copies). Works with triton 3.6 .. 3.9 (ASTSource +
    GPUTarget("cuda", 90, 32)).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arg_names = kernel.arg_names  # type: ignore[attr-defined]
    # constexprs left out take their declared defaults, as at a JIT launch (ASTSource itself needs every one)
    params = kernel.params  # type: ignore[attr-defined]
    constexprs = {p.name: p.default for p in params if p.is_constexpr and p.has_default} | dict(constexprs)
    sig = dict(signature) | {k: "constexpr" for k in constexprs}
    attrs = {(arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible_by_16}
    src = ASTSource(kernel, sig, constexprs={(arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    ptx = compiled.asm["ptx"]
    usage = cuobjdump(compiled, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    if m is None:
        raise RuntimeError(f"sm90_compile_report: no resource line in cuobjdump output: {usage[-300:]!r}")
    return {
        "regs": int(m.group(1)),
        "stack": int(m.group(2)),
        "shared_static": int(m.group(3)),
        "shared": int(compiled.metadata.shared),
        "wgmma": "wgmma" in ptx,
        "mma": "mma.sync" in ptx,
        "cp_async": "cp.async" in ptx,
    }


def run_compile_script(script: str, *, timeout: float = 600) -> dict:
    """Run `script` (Python source printing one JSON line last) in a child process without TRITON_INTERPRET, with
    this support folder on its path, and return the parsed JSON. Compiling for sm_90a needs triton's real backend,
    which the interpreter mode of the parent test session would replace."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    support = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (support, env.get("PYTHONPATH")) if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 = its current default
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
