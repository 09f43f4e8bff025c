"""Building this project's C++ CPU kernels (int4_bf16dot.cpp, query_attention.cpp, rms_norm.cpp) at first use,
with torch.utils.cpp_extension: a C++ compiler and ninja, one build directory per kernel and torch version under
torch's extension root, reused by later processes. A kernel that cannot be built is a warning and the caller's
fallback (or its one-line refusal, where a setting forced the kernel); a build lock left behind by a killed
build is waited for a while, not forever.
"""

import logging
import os
import subprocess
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# at::parallel_for is OpenMP in PyTorch's CPU builds: compiled without -fopenmp its pragma is ignored and every
# kernel runs on one thread whatever torch.set_num_threads says. The link names libgomp.so.1, which the loader
# resolves to the copy torch has already loaded (same soname), so torch's thread setting governs the kernels.
OPENMP_FLAGS = ["-fopenmp"]


# A first build takes about a minute; a lock that outlives this was left by a process killed during a build.
BUILD_LOCK_WAIT_S = 180.0


def kernel_build_directory(name: str) -> Path:
    """Where extension `name` is built and cached: under torch's extension root (TORCH_EXTENSIONS_DIR, else
    torch's cache), one directory per extension and torch version. Named here so that wait_for_build_lock
    knows the lock file torch.utils.cpp_extension keeps in it while it builds."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    directory = Path(root) / f"{name}-torch-{torch.__version__}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def wait_for_build_lock(directory: Path, wait_s: float = BUILD_LOCK_WAIT_S) -> str | None:
    """Wait while another process builds in `directory` (torch's lock file there). torch would wait forever,
    and a process killed during a build (kill -9, out of memory) leaves the file behind: after `wait_s`, why
    the build cannot go on, or None once the lock is gone."""
    lock = directory / "lock"
    if not lock.exists():
        return None
    log.warning("waiting up to %g s for %s: another process is building this kernel", wait_s, lock)
    deadline = time.monotonic() + wait_s
    while lock.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if lock.exists():
        return f"{lock} is still there after {wait_s:g} s: a build was killed midway; delete it if none is running"
    return None


def build_cpu_kernel(kernel: str, name: str, source: Path, cflags: list[str], fallback: str, fake: dict) -> str | None:
    """Build and load one of this project's C++ CPU kernels (torch.utils.cpp_extension: a C++ compiler and ninja;
    the first build takes seconds to a minute, later processes reuse the build) and register the output shapes
    of its operators for torch.compile (`fake`: operator name -> function). Why it cannot (warned once, naming the
    `fallback` that serves instead), or None. kernel: its name for people; name: the extension's."""
    from torch.utils import cpp_extension

    try:
        directory = kernel_build_directory(name)
        problem = wait_for_build_lock(directory)
        if problem is None:
            cpp_extension.load(
                name,
                [str(source)],
                extra_cflags=[*cflags, *OPENMP_FLAGS],
                extra_ldflags=OPENMP_FLAGS,
                build_directory=str(directory),
                is_python_module=False,
            )
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as error:
        problem = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if problem is not None:
        log.warning("the %s kernel could not be built, %s instead: %s", kernel, fallback, problem)
        return problem
    for operator, shape in fake.items():
        torch.library.register_fake(operator)(shape)
    return None
