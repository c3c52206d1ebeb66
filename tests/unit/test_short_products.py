"""The short prefill pass's products (torch_triton_short.py) on Triton's CPU interpreter,
with float32 weights (exact products): each mode against a float64 reference, whole or with
its K range split over programs (K not a multiple of the step, columns not a multiple of
the tile), the norm's squares summed across the splits; the counts are zero after every
launch, and the split sum is the same every run."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import rerun_interpreted

EPS = 1e-5


def _normed(x, g):
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * g.double()


@pytest.mark.parametrize("split_k", [1, 3])
def test_short_products_match_the_reference(split_k, request):
    if rerun_interpreted(request):
        return
    from llm_runner_svc.engines.torch_triton_modes import ACCUMULATE, SILU_GATE, STORE, Tiling
    from llm_runner_svc.engines.torch_triton_short import ShortProducts

    gen = torch.Generator().manual_seed(5)
    m, n, k = 13, 40, 100
    tiles = Tiling(bn=16, bk=32, split_k=split_k, warps=4, stages=1)
    shapes = [(n, k, STORE, True), (n, k, STORE, False), (n, k, ACCUMULATE, False),
              (n, k, SILU_GATE, True), (n, k, SILU_GATE, False)]
    sp = ShortProducts(EPS, tilings={
        s: tiles._replace(split_k=1) if s[2] == SILU_GATE else tiles for s in shapes})
    sp.reserve(torch.device("cpu"))

    x = torch.randn(m, k, generator=gen) * 3.0
    g = torch.rand(k, generator=gen) + 0.5
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    bias = torch.randn(n, generator=gen)
    out = torch.zeros(m, n)
    assert sp.norm_product(x, g, w, bias, out)
    want = _normed(x, g) @ w.double().t() + bias.double()
    assert (out.double() - want).abs().max().item() < 1e-4
    assert sp.product(x, w, None, out)
    assert (out.double() - x.double() @ w.double().t()).abs().max().item() < 1e-4

    a = torch.randn(m, k, generator=gen)
    res = torch.randn(m, n, generator=gen)
    acc = res.clone()
    assert sp.accumulate(a, w, acc)
    want = res.double() + a.double() @ w.double().t()
    assert (acc.double() - want).abs().max().item() < 1e-4
    again = res.clone()
    assert sp.accumulate(a, w, again)
    assert torch.equal(again, acc)  # the partials summed in the same order

    gate_up = torch.randn(2 * n, k, generator=gen) / k ** 0.5
    act = torch.zeros(m, n)
    assert sp.norm_gate(x, g, gate_up, act)
    gu = _normed(x, g) @ gate_up.double().t()
    want = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
    assert (act.double() - want).abs().max().item() < 1e-4
    assert sp.gate(x, gate_up, act)
    gu = x.double() @ gate_up.double().t()
    want = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
    assert (act.double() - want).abs().max().item() < 1e-4
    assert int(sp._count.abs().sum()) == 0  # type: ignore[union-attr]
    # a product without a tiling launches nothing: its caller multiplies on cuBLAS
    assert not sp.accumulate(a[:, :64], w[:, :64].contiguous(), acc)


def test_tilings_are_checked_and_loaded():
    from llm_runner_svc.engines.torch_triton_modes import SILU_GATE, Tiling, load_tilings
    from llm_runner_svc.engines.torch_triton_short import ShortProducts

    with pytest.raises(ValueError, match="split_k must be 1"):
        ShortProducts(EPS, {(8, 32, SILU_GATE, False): Tiling(16, 32, 2, 4, 1)})
    got = load_tilings('{"tilings": [[8, 32, 2, false, 16, 32, 1, 4, 3]]}')
    assert got == {(8, 32, SILU_GATE, False): Tiling(16, 32, 1, 4, 3)}
