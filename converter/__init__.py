"""dflash_llama.converter: Hugging Face DFlash draft checkpoints -> GGUF for the pinned llama.cpp.

`dflash_llama.schema` is the one table of DFlash GGUF keys and tensor names; `convert` writes it.
"""

from .checkpoint import ConversionError
from .conversion import OUTTYPES, convert

__all__ = ["ConversionError", "OUTTYPES", "convert"]
