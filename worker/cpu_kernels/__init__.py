"""Sluice's own CPU kernels (``qgemm.cpp``): weight-only quantized matmuls of the decode rows, built on first use.

``q4_linear(x, codes, scale, zero)`` and ``q8_linear(x, codes, scale)`` compute ``x [M, K] @ W[N, K]^T`` in float32
from weights in groups of 32 input features (GGUF's Q4_0/Q4_1 and Q8_0 layouts), quantizing each row of ``x`` to
int8 per group on the fly, as llama.cpp's AVX2 path does (the layouts and the arithmetic are in ``qgemm.cpp``). Each
output depends on its own row and weight row only, computed in a fixed order: a sequence's tokens do not depend on
its neighbours in the batch nor on the number of threads.

The extension is compiled with :func:`torch.utils.cpp_extension.load` (g++, ninja, AVX2 + FMA) into
``<cache_root>/cpu_kernels/<torch version>/<source key>`` the first time a worker needs it (about a minute on a
2-core machine; ``make install`` does it once ahead: ``python -m worker.cpu_kernels``), then loaded from there in
about 0.1 s. :func:`load` returns None where the CPU lacks AVX2 or the build fails (the reason is logged once); the
quantized layers then run their dense copy instead. The source key hashes the sources' folder and contents: ninja's
build file names the sources by absolute path, so two checkouts sharing one folder would each rebuild over the
other's build at every start. Loads of one folder take turns (:func:`build_lock`), which also clears what a killed
build left.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import structlog
import torch

log = structlog.get_logger("sluice.worker")

SOURCES = [os.path.join(os.path.dirname(__file__), name)
           for name in ("module.cpp", "qgemm.cpp", "paged_attention.cpp", "elementwise.cpp")]
#: input features per group of the quantized layouts
GROUP_SIZE = 32
BUILD_LOCK_NAME = "sluice-build.flock"  # held (flock) by every load of a build folder
TORCH_BATON_NAME = "lock"  # torch.utils.file_baton.FileBaton's file in the build folder


def cpu_supports_kernels() -> bool:
    """Whether this CPU runs the kernels: AVX2 with FMA (torch's CPU capability AVX2 or AVX512)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def source_key() -> str:
    """Return 12 hex digits of a hash of the sources' folder and of every file in it (the build's inputs)."""
    folder = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.blake2b(folder.encode(), digest_size=6)
    for name in sorted(os.listdir(folder)):
        if name.endswith((".cpp", ".h")):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def build_directory() -> str:
    from shared.model_files import cache_root

    return os.path.join(cache_root(), "cpu_kernels", torch.__version__.replace("+", "-"), source_key())


@functools.cache
def load() -> ModuleType | None:
    """Return the compiled kernels (building them on first use), or None where they cannot run here.

    Raises nothing: a CPU without AVX2, a missing compiler or a failed build logs ``cpu_kernels_unavailable`` with
    the reason and returns None.
    """
    if not cpu_supports_kernels():
        log.warning("cpu_kernels_unavailable", reason=f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                    "not AVX2")
        return None
    from torch.utils import cpp_extension

    # ninja comes with the package (pip's ninja puts it beside the interpreter, which PATH may not name)
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    folder = build_directory()
    os.makedirs(folder, exist_ok=True)
    if not os.path.exists(os.path.join(folder, "sluice_qgemm.so")):
        log.info("cpu_kernels_building", build_directory=folder,
                 note="first use from this checkout: about a minute on 2 cores (make install builds ahead)")
    try:
        with build_lock(folder):
            return cpp_extension.load(
                name="sluice_qgemm", sources=SOURCES, build_directory=folder, verbose=False,
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
            )
    except Exception as exc:  # noqa: BLE001 - any build failure falls back to the dense path, said once
        log.warning("cpu_kernels_unavailable", reason=f"build failed: {exc}"[:2000], build_directory=folder)
        return None


@contextlib.contextmanager
def build_lock(folder: str) -> Iterator[None]:
    """Hold the build folder's lock (``flock`` on ``sluice-build.flock``, which the kernel releases when its holder
    dies) and remove torch's own lock file (``lock``, a ``FileBaton``) left there by a build that was killed.

    torch's baton is a file that only its creator deletes: a build killed mid-way (a worker stopped while it
    compiled, Ctrl-C in ``make install``) leaves it, and every later :func:`torch.utils.cpp_extension.load` of the
    folder waits for it to go away, for ever. Every load here runs under this lock, so a baton found while holding
    it belongs to no live build.
    """
    with open(os.path.join(folder, BUILD_LOCK_NAME), "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            stale = os.path.join(folder, TORCH_BATON_NAME)
            if os.path.exists(stale):
                log.warning("cpu_kernels_stale_lock_removed", path=stale,
                            note="left by a build that was killed; building again")
                os.remove(stale)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
