"""The short-window products (torch_triton_skinny.py) on Triton's CPU interpreter, float32:
stored, with a bias, and accumulated onto a residual, with the K range split over several
programs (whose last one sums the partials) or not, for row counts up to the kernel's
limit and widths that leave a partial column tile; the counts are zero after each launch
and a product it does not take launches nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def test_skinny_products_match_torch(request):
    if os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter is chosen when the kernels are first compiled: run this case
        # again in a process that starts with it
        pytest.importorskip("triton")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              request.node.nodeid], env=env, capture_output=True, text=True,
                             cwd=request.config.rootpath, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:]
        assert "1 passed" in out.stdout
        return
    from llm_runner_svc.engines.torch_triton_skinny import MAX_ROWS, SkinnyProducts, Tiling

    gen = torch.Generator().manual_seed(5)
    cpu = torch.device("cpu")
    shapes = [(200, 2048), (96, 1024)]  # both split at num_sms 64
    sk = SkinnyProducts(num_sms=64)
    sk.reserve(shapes, cpu)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        for m in (1, 13, MAX_ROWS):
            a = torch.randn(m, k, generator=gen)
            for tiles in (Tiling(64, 128, 1, 4, 1), Tiling(64, 128, 4, 4, 1),
                          Tiling(128, 64, 2, 4, 1), None):
                out = torch.full((m, n), float("nan"))
                assert sk.product(a, w, out, tiles=tiles)
                torch.testing.assert_close(out, a @ w.T, rtol=1e-5, atol=1e-4)
                out = torch.zeros(m, n)
                assert sk.product(a, w, out, bias=bias, tiles=tiles)
                torch.testing.assert_close(out, a @ w.T + bias, rtol=1e-5, atol=1e-4)
                x = torch.randn(m, n, generator=gen)
                want = x + a @ w.T
                assert sk.product(a, w, x, accumulate=True, tiles=tiles)
                torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-4)
                assert sk._count is not None and int(sk._count.abs().sum()) == 0
    too_many = torch.randn(MAX_ROWS + 1, 2048)
    out = torch.zeros(MAX_ROWS + 1, 200)
    assert not sk.product(too_many, torch.randn(200, 2048), out)
    assert int(out.abs().sum()) == 0
