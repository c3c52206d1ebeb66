"""One eager decode step of the torch engine at a named shape, between cudaProfilerStart and
Stop, for a kernel profiler to time kernel by kernel:

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python benchmarks/step_kernels.py qwen2.5-1.5b [batch]
"""

from __future__ import annotations

import sys

import torch

from llm_runner_svc.engines.base import DecodeRow, EnginePlan
from llm_runner_svc.engines.torch_engine import TorchEngine
from llm_runner_svc.engines.torch_state import decode_views
from llm_runner_svc.engines.torch_weights import named_shape, random_weights


def main() -> None:
    name = sys.argv[1]
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    config = named_shape(name)
    eng = TorchEngine(config, random_weights(config, torch.device("cuda"), torch.bfloat16),
                      device="cuda")
    eng.preallocate(EnginePlan(max_batch=batch, max_seq=272, page_size=16,
                               num_pages=batch * 17))
    rows = [DecodeRow(7, 200, list(range(i * 17, i * 17 + 13))) for i in range(batch)]
    eng.decode(rows)  # stages the inputs
    ids, positions, tables = decode_views(eng.state, batch)
    eng.forward.decode(batch, ids, positions, tables, False)  # warm
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    eng.forward.decode(batch, ids, positions, tables, False)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
