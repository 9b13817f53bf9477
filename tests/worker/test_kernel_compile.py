"""The CUDA decode kernel compiles for sm_80 and sm_90, every instance, without register spills.

Needs no GPU: ``nvcc`` builds cubins (ptxas reports registers and spills), and NVRTC, the compiler CuPy uses at run
time, builds each per-instance module exactly as :mod:`worker.attention.cupy_paged` asks for it. Each part skips
with the reason when its compiler is missing.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worker.attention.cupy_paged import KERNEL_SOURCE_PATH, compile_options, kernel_names
from worker.attention.partitioned_ref import HEADS_PER_CTA_CHOICES, SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS
from worker.cuda_kernels import LAYER_OPS_KERNELS, SOURCE_PATH

DTYPE_NAMES = ("bf16", "f16")
ARCHS = ("sm_80", "sm_90")
NVCC_TIMEOUT_S = 300


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").is_file():
            return str(Path(root, "bin", "nvcc"))
    return None


NVCC = _find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")


def _all_instances() -> list[tuple[str, int, int]]:
    return [(d, h, b) for d in DTYPE_NAMES for h in SUPPORTED_HEAD_DIMS for b in SUPPORTED_BLOCK_SIZES]


def _expected_entries() -> set[str]:
    names: set[str] = set()
    for dtype_name, head_dim, block_size in _all_instances():
        for heads in HEADS_PER_CTA_CHOICES:
            names.update(kernel_names(dtype_name, head_dim, block_size, heads))
    return names


def _ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """Parse ``-Xptxas -v`` output into {entry: {registers, spill_stores, spill_loads, stack}}."""
    report: dict[str, dict[str, int]] = {}
    for chunk in re.split(r"Compiling entry function '", log)[1:]:
        name = chunk.split("'", 1)[0]
        report[name] = {
            "registers": int(re.search(r"Used (\d+) registers", chunk).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", chunk).group(1)),
            "spill_loads": int(re.search(r"(\d+) bytes spill loads", chunk).group(1)),
            "stack": int(re.search(r"(\d+) bytes stack frame", chunk).group(1)),
        }
    return report


def _compile_cubin(arch: str, source: Path, cubin: Path) -> dict[str, dict[str, int]]:
    """Build ``source`` into ``cubin`` with nvcc for ``arch`` (no warning allowed); return ptxas' report."""
    proc = subprocess.run(
        [NVCC, f"-arch={arch}", "-cubin", "-O3", "-Xptxas", "-v", "-o", str(cubin), str(source)],
        capture_output=True,
        text=True,
        timeout=NVCC_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-4000:]
    return _ptxas_report(proc.stderr)


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_instance_compiles_without_spills(arch: str, tmp_path: Path) -> None:
    cubin = tmp_path / f"paged_decode_{arch}.cubin"
    report = _compile_cubin(arch, KERNEL_SOURCE_PATH, cubin)
    assert set(report) == _expected_entries()
    spilling = {name: r for name, r in report.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]}
    assert not spilling, f"register spills / stack frames on {arch}: {spilling}"
    assert cubin.stat().st_size > 0


@needs_nvcc
@pytest.mark.parametrize(("dtype_name", "head_dim", "block_size"), _all_instances())
def test_selected_module_holds_exactly_its_kernels(
    dtype_name: str, head_dim: int, block_size: int, tmp_path: Path
) -> None:
    """The defines cupy_paged passes compile only the asked-for instance (PTX, sm_90)."""
    ptx = tmp_path / "selected.ptx"
    proc = subprocess.run(
        [NVCC, "-arch=sm_90", "--ptx", *compile_options(dtype_name, head_dim, block_size), "-o", str(ptx),
         str(KERNEL_SOURCE_PATH)],
        capture_output=True,
        text=True,
        timeout=NVCC_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx.read_text()))
    expected = {n for h in HEADS_PER_CTA_CHOICES for n in kernel_names(dtype_name, head_dim, block_size, h)}
    assert entries == expected


def _find_nvrtc() -> str | None:
    """libnvrtc from $SLUICE_NVRTC_LIB, pip's nvidia packages (CuPy's [ctk] / torch's), or the CUDA toolkit."""
    explicit = os.environ.get("SLUICE_NVRTC_LIB")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    candidates: list[Path] = []
    for site in map(Path, sys.path):
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            candidates.extend(sorted((site / sub).glob("libnvrtc.so*")))
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            candidates.extend(sorted(Path(root, "lib64").glob("libnvrtc.so*")))
    plain = [c for c in candidates if "alt" not in c.name and "builtins" not in c.name]
    return str(plain[0]) if plain else None


NVRTC = _find_nvrtc()


def _nvrtc_compile(lib_path: str, source: str, options: list[str]) -> tuple[int, str, bytes]:
    """Compile with NVRTC through ctypes; return (result code, log, PTX)."""
    for builtins in sorted(Path(lib_path).parent.glob("libnvrtc-builtins.so*")):  # NVRTC dlopens it by name
        if "alt" not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"paged_decode_attention.cu", 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram failed: {rc}"
    opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
    result = lib.nvrtcCompileProgram(prog, len(options), opts)
    log_size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
    log = ctypes.create_string_buffer(log_size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = b""
    if result == 0:
        ptx_size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size))
        buf = ctypes.create_string_buffer(ptx_size.value)
        lib.nvrtcGetPTX(prog, buf)
        ptx = buf.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return result, log.value.decode(errors="replace"), ptx


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (set SLUICE_NVRTC_LIB, or pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize(("dtype_name", "head_dim", "block_size"), _all_instances())
def test_nvrtc_compiles_each_module_as_cupy_asks(dtype_name: str, head_dim: int, block_size: int) -> None:
    """NVRTC (no system headers, CuPy's run-time compiler) builds every per-instance module for sm_90."""
    options = ["--gpu-architecture=compute_90", *compile_options(dtype_name, head_dim, block_size)]
    result, log, ptx = _nvrtc_compile(NVRTC, KERNEL_SOURCE_PATH.read_text(), options)
    assert result == 0, log
    entries = set(re.findall(rb"\.entry\s+(\w+)\(", ptx))
    expected = {n.encode() for h in HEADS_PER_CTA_CHOICES for n in kernel_names(dtype_name, head_dim, block_size, h)}
    assert entries == expected


LAYER_OPS_ENTRIES = set(LAYER_OPS_KERNELS)


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_layer_ops_compile_without_spills(arch: str, tmp_path: Path) -> None:
    """worker/cuda_kernels/layer_ops.cu: every entry point cuda_kernels launches is there, none spills."""
    report = _compile_cubin(arch, SOURCE_PATH, tmp_path / "layer_ops.cubin")
    assert set(report) == LAYER_OPS_ENTRIES
    assert not {name: r for name, r in report.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]}
