"""The short prefill pass's products (torch_triton_short.py) on Triton's CPU interpreter,
with float32 weights (exact products): each mode against a float64 reference, whole or with
its K range split over programs (K not a multiple of the step, columns not a multiple of
the tile), the norm's squares summed across the splits; the counts are zero after every
launch, and the split sum is the same every run. And the engine's short passes on them,
against the plain-torch reference ops."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import rerun_interpreted  # noqa: E402

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
    sp = ShortProducts(EPS, tilings=dict.fromkeys(shapes, tiles))
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

    for bad in (Tiling(24, 32, 1, 4, 1), Tiling(16, 48, 1, 4, 1), Tiling(16, 32, 0, 4, 1),
                Tiling(16, 32, 1, 4, 0)):
        with pytest.raises(ValueError, match="powers of two"):
            ShortProducts(EPS, {(8, 32, SILU_GATE, False): bad})
    got = load_tilings('{"tilings": [[8, 32, 2, false, 16, 32, 1, 4, 3]]}')
    assert got == {(8, 32, SILU_GATE, False): Tiling(16, 32, 1, 4, 3)}
    assert got[(8, 32, SILU_GATE, False)].evict == 0
    got = load_tilings('{"tilings": [[8, 32, 2, false, 16, 32, 2, 4, 3, 1]]}')
    assert got == {(8, 32, SILU_GATE, False): Tiling(16, 32, 2, 4, 3, evict=1)}


def test_short_passes_in_the_engine_match_the_reference_ops(stories, request, monkeypatch):
    """The torch engine's triton kernels on the interpreter (float32), prefill passes of
    50, 50 and 20 tokens with every product of each layer on the short products (the norm
    inside q/k/v, before gate/up; o, gate/up and down split over programs) against the plain-torch
    reference ops: the same logits and hidden states to float32 rounding, and every
    product of every pass took the short kernel."""
    if rerun_interpreted(request):
        return
    import numpy as np

    from llm_runner_svc.engines import create_engine
    from llm_runner_svc.engines.base import EnginePlan
    from llm_runner_svc.engines.torch_triton_modes import ACCUMULATE, SILU_GATE, STORE, Tiling
    from llm_runner_svc.engines.torch_triton_short import ShortProducts

    c = stories.config
    tilings = {(c.q_dim + 2 * c.kv_dim, c.hidden_size, STORE, True): Tiling(32, 32, 1, 4, 1),
               (c.hidden_size, c.q_dim, ACCUMULATE, False): Tiling(16, 32, 2, 4, 1),
               (c.intermediate_size, c.hidden_size, SILU_GATE, False): Tiling(32, 32, 2, 4, 1, 1),
               (c.hidden_size, c.intermediate_size, ACCUMULATE, False): Tiling(16, 64, 3, 4, 1)}
    launched = []
    launch = ShortProducts._launch

    def counted(self, *args, **kw):
        launched.append(launch(self, *args, **kw))
        return launched[-1]

    monkeypatch.setattr(ShortProducts, "_launch", counted)
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, c.vocab_size, 120)]
    got = []
    for kernels, opts in (("torch", {}), ("triton", {"fused_prefill_rows": 0,
                                                     "short_tilings": tilings})):
        eng = create_engine("torch", c, stories.weights, device="cpu", kernels=kernels,
                            **opts)
        table = list(range(8))
        eng.preallocate(EnginePlan(max_batch=1, max_seq=128, page_size=16, num_pages=8,
                                   prefill_chunk=50, hidden_layer=-1))
        states = eng.prefill(prompt, 0, table, capture_hidden=True).states
        got.append((eng.logits(1).copy(), np.asarray(states, np.float32)))
        eng.close()
    assert sum(launched) == 4 * c.num_layers * 3
    np.testing.assert_allclose(got[1][0], got[0][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1][1], got[0][1], rtol=1e-4, atol=1e-4)
