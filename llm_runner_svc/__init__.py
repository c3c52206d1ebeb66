"""llm_runner_svc: the LlmRunner stage, its inference runtime, engines and model loaders."""

import os as _os
import platform as _platform

# OpenBLAS picks its SkylakeX sgemm kernels on AVX-512 CPUs. For the few-row products of a
# decode step (a handful of rows against a large weight matrix) they run at about half the
# speed of its Haswell kernels, while large products are within a few percent (measured in
# docs/benchmarks.md). Unless the user chose a core type, ask for Haswell on x86-64. This
# only takes effect when numpy has not been imported yet, which is the case for our entry
# points (the CLI, the services, the test suite).
if _platform.machine().lower() in ("x86_64", "amd64"):
    _os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

__version__ = "0.1.0"
