"""Build of specdec and its optional extension ``specdec._C`` (csrc/), with ninja.

Environment variables:
  SPECDEC_SKIP_EXTENSION=1   install the pure-Python package only
  SPECDEC_CPU_ONLY=1         build the C++ extension without CUDA sources
  SPECDEC_CUDA_ARCHS="9.0;8.0"  GPU architectures of the CUDA build (default sm_90 and sm_80)
  MAX_JOBS=N                 parallel compile jobs (default: capped by cores and memory)

A CUDA build happens when torch itself was built with CUDA and nvcc is found
(CUDA_HOME); otherwise the extension is C++ only. Build without isolation so the
extension links against the torch you run: ``pip install --no-build-isolation -e .``
"""

import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"


def flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def cap_parallel_jobs() -> None:
    """Each nvcc/cc1plus job can take ~2 GiB; never ask for more jobs than cores or memory allow."""
    if "MAX_JOBS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = 4.0
    os.environ["MAX_JOBS"] = str(max(1, min(cores, int(mem_gib // 2))))


def extension_modules():
    if flag("SPECDEC_SKIP_EXTENSION"):
        return [], {}
    import torch
    from torch.utils import cpp_extension

    cap_parallel_jobs()
    sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp"))
    cxx_flags = ["-O3"]  # the C++ standard is the one torch's cpp_extension picks for its headers
    # libstdc++ from the shared library that torch itself uses, named before the compiler's own libraries: a
    # toolchain that links it statically (seen on the H200 image) gave the extension a second copy whose
    # streams wrote truncated error messages, or crashed, once Python's -Bsymbolic-functions mixed the copies.
    link_flags = ["-lstdc++"] if sys.platform.startswith("linux") else []
    use_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and not flag("SPECDEC_CPU_ONLY")
    if use_cuda:
        archs = os.environ.get("SPECDEC_CUDA_ARCHS", "9.0;8.0")
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        sources += sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cu"))
        ext = cpp_extension.CUDAExtension(
            "specdec._C",
            sources,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
            extra_link_args=link_flags,
        )
    else:
        ext = cpp_extension.CppExtension(
            "specdec._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags
        )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True)
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = extension_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
