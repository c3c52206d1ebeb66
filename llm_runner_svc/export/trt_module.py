"""Find a TensorRT Python module: full TensorRT (`tensorrt`) or TensorRT-RTX, whose wheel
installs as `tensorrt_rtx` with the bindings in `tensorrt_rtx_bindings`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from llm_runner_svc.errors import Unimplemented

MODULE_NAMES = ("tensorrt", "tensorrt_rtx", "tensorrt_rtx_bindings")


@dataclass(frozen=True)
class TensorRT:
    """The imported module and what it is."""

    module: ModuleType
    name: str  # the module name that imported
    version: str

    @property
    def is_rtx(self) -> bool:
        return self.name != "tensorrt"


def import_tensorrt(names: tuple[str, ...] = MODULE_NAMES) -> TensorRT:
    """The first of `names` that imports; Unimplemented naming the extra when none does."""
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return TensorRT(module, name, str(getattr(module, "__version__", "unknown")))
    raise Unimplemented(
        f"no TensorRT module ({' or '.join(names)}) is installed; "
        "pip install 'llm-runner-svc[tensorrt]' for TensorRT-RTX")
