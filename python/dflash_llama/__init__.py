"""dflash-llama: DFlash speculative decoding on GGUF models.

Native pieces live in the compiled module `dflash_llama._core` (runtime/ + bindings/); the
PyTorch reference, converter, trainer, parity harness and benchmarks are the subpackages
`dflash_llama.reference`, `.converter`, `.train`, `.parity` and `.bench`. Importing this package
and using `Runtime` or `gguf_info` needs numpy only (no torch): the base install.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _dist_version

from ._gguf import GGUFInfo, TensorInfo, gguf_info
from .runtime import Generation, Runtime, Step, Stream

try:
    __version__ = _dist_version("dflash-llama")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"


def llama_cpp_commit() -> str:
    """The pinned llama.cpp commit, as recorded by the build of the native module."""
    from . import _core

    return _core.llama_cpp_commit()


def supports_gpu_offload() -> bool:
    """Whether this build has a GPU backend with a device, so that `n_gpu_layers` / `-ngl` offload."""
    from . import _core

    return _core.supports_gpu_offload()


__all__ = ["GGUFInfo", "Generation", "Runtime", "Step", "Stream", "TensorInfo", "gguf_info",
           "llama_cpp_commit", "supports_gpu_offload", "__version__"]
