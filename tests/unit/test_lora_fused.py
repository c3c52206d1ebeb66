"""LoRA terms inside the fused few-row products (torch_triton_products.py), run by Triton's
CPU interpreter in float32, against the grouped torch products (torch_lora.py):

- each product mode with its term: q/k/v (RMSNorm prologue, bias), o and down (accumulated
  into the residual stream), gate/up (RMSNorm prologue, SiLU gate epilogue), on rows that
  mix the base model and several adapters; the shrink must norm its input as the product
  does and the gate/up term must go in before the SiLU, which the test shows it would
  notice;
- gate/up's expand, SiLU gate and down's shrink in one kernel (the unfused products' path);
- a whole decode step of the forward with fused products and the terms inside them, and
  one unfused with the per-row and the grouped kernels, against the same step unfused with
  the grouped products.
The same paths in bf16 on a GPU: tests/unit/test_lora_gpu.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lora_fixtures import write_adapter  # noqa: E402
from triton_interpreter import rerun_interpreted  # noqa: E402

from llm_runner_svc.engines.base import EnginePlan  # noqa: E402
from llm_runner_svc.engines.torch_forward import Forward  # noqa: E402
from llm_runner_svc.engines.torch_lora import TorchLora  # noqa: E402
from llm_runner_svc.engines.torch_ops import TorchOps  # noqa: E402
from llm_runner_svc.engines.torch_state import allocate_state  # noqa: E402
from llm_runner_svc.engines.torch_triton_modes import SILU_GATE  # noqa: E402
from llm_runner_svc.engines.torch_weights import load_weights  # noqa: E402
from llm_runner_svc.models.lora import load_adapter  # noqa: E402

CPU = torch.device("cpu")
ROWS = {1: [2], 3: [1, 0, 3], 4: [0, 3, 1, 2]}  # adapter slot per row (0: the base model)


@pytest.fixture(scope="module")
def adapters(stories, tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return [load_adapter(f"f{i}", write_adapter(root / f"f{i}", stories.config, seed=20 + i,
                                                rank=4 - i), stories.config)
            for i in range(3)]


def _lora(cfg, adapters, kernel: str) -> TorchLora:
    lora = TorchLora(cfg, adapters, CPU, max_rank=4, kernel=kernel)
    lora.reserve(4)
    return lora


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * g


def _silu_gate(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))


@pytest.mark.parametrize("n", list(ROWS))
@pytest.mark.parametrize("matrix", ["qkv", "o", "gate_up", "down"])
def test_fused_products_add_each_rows_term(stories, adapters, matrix, n, request):
    if rerun_interpreted(request):
        return
    from llm_runner_svc.engines.torch_triton_products import FusedProducts

    cfg = stories.config
    eps = cfg.rms_eps
    lora, grouped = _lora(cfg, adapters, "triton"), _lora(cfg, adapters, "grouped")
    slots = ROWS[n]
    idx = torch.tensor(slots, dtype=torch.int32)
    groups = grouped.groups(slots, [1] * n)
    layer = 1
    gen = torch.Generator().manual_seed(n)
    n_in, n_out = lora.a[matrix].shape[2], lora.b[matrix].shape[3]
    w = torch.randn(n_out, n_in, generator=gen) / n_in ** 0.5  # [out, in] float32 weights
    x = 3.0 * torch.randn(n, n_in, generator=gen)  # an input whose RMS is far from 1
    g = 0.5 + torch.rand(n_in, generator=gen)  # norm weight
    products = FusedProducts(eps)
    lora.begin_rows(idx)
    if matrix in ("o", "down"):  # x += a @ W.T + term(a)
        res = torch.randn(n, n_out, generator=gen)
        got, want = res.clone(), res + x @ w.t()
        products.accumulate(x, w, got, lora.shrink_rows(layer, matrix, x, idx))
        grouped.add(layer, matrix, x, want, groups)
        assert _close(got, want)
        return
    h = _rms(x, g, eps)
    if matrix == "qkv":  # rms_norm(x) @ W.T + bias + term(rms_norm(x))
        bias = torch.randn(n_out, generator=gen)
        got = torch.empty(n, n_out)
        products.norm_product(x, g, w, bias, got, lora.shrink_rows(layer, matrix, x, idx, g))
        want = h @ w.t() + bias
        grouped.add(layer, matrix, h, want, groups)
        unnormed = h @ w.t() + bias  # the term of the input before its norm
        grouped.add(layer, matrix, x, unnormed, groups)
        wrong = [unnormed]
    else:  # silu(g) * u of rms_norm(x) @ W.T + term(rms_norm(x))
        got = torch.empty(n, n_out // 2)
        products.norm_gate(x, g, w, got, lora.shrink_rows(layer, matrix, x, idx, g))
        gu = h @ w.t()
        grouped.add(layer, matrix, h, gu, groups)
        want = _silu_gate(gu)
        unnormed = h @ w.t()
        grouped.add(layer, matrix, x, unnormed, groups)
        after = torch.zeros(n, n_out)  # the term added after the SiLU gate
        grouped.add(layer, matrix, h, after, groups)
        wrong = [_silu_gate(unnormed), _silu_gate(h @ w.t()) + after[:, :n_out // 2]]
    assert _close(got, want)
    on_adapter = [i for i, k in enumerate(slots) if k]
    for other in wrong:  # the slips this test is here to catch would fail it
        assert not _close(other[on_adapter], want[on_adapter])


def _step(forward: Forward, slots: list[int], per_row: bool, fused: bool) -> torch.Tensor:
    """Logits [n, vocab] of one decode step at position 0 of rows on adapter `slots`: by
    each row's slot on the device (`per_row`; on the fused products when `fused`), else by
    the grouped products (unfused)."""
    n = len(slots)
    forward.fused_rows = 4 if fused else 0
    ids = torch.tensor([7 + 5 * i for i in range(n)], dtype=torch.int32)
    positions = torch.zeros(n, dtype=torch.int32)
    tables = (torch.arange(n)[:, None] * 2 + torch.arange(2)[None, :]).int()
    assert forward.lora is not None
    if per_row:
        forward.decode(n, ids, positions, tables, False,
                       lora_slots=torch.tensor(slots, dtype=torch.int32))
    else:
        forward.decode(n, ids, positions, tables, False, forward.lora.groups(slots, [1] * n))
    return forward.s.logits[:n].clone()


@pytest.fixture
def forward(stories, adapters) -> Forward:
    """A float32 CPU forward whose ops have the fused products (run by the interpreter)."""
    from llm_runner_svc.engines.torch_triton_products import FusedProducts

    cfg = stories.config
    plan = EnginePlan(max_batch=6, max_seq=8, page_size=4, num_pages=12, prefill_chunk=8)
    state = allocate_state(cfg, plan, CPU, torch.float32, has_wide_scratch=False,
                           fused_rows=4)
    ops = TorchOps(cfg, plan.page_size)
    ops.products = FusedProducts(cfg.rms_eps)
    return Forward(cfg, load_weights(stories.weights, cfg, CPU, torch.float32), ops, state,
                   None, plan.page_size, True, lora=_lora(cfg, adapters, "triton"))


@pytest.mark.parametrize("is_gate_fused", [True, False])
def test_fused_decode_step_with_terms_matches_the_unfused_one(adapters, request, forward,
                                                              monkeypatch, is_gate_fused):
    """Every product fused, or all but gate/up (a large model's batch 1: gate/up's
    expand, SiLU gate and down's shrink in one kernel, down's term in its fused product)."""
    if rerun_interpreted(request):
        return
    if not is_gate_fused:
        monkeypatch.setattr(forward.products, "outruns_cublas",
                            lambda w, mode: mode != SILU_GATE)
    slots = ROWS[4]
    want = _step(forward, slots, per_row=False, fused=False)
    got = _step(forward, slots, per_row=True, fused=True)
    assert _close(got, want)
    base = _step(forward, [0] * 4, per_row=True, fused=True)
    assert torch.equal(got[0], base[0])
    assert not _close(got[1:], base[1:])
    lora = forward.lora
    assert lora is not None
    shrink = lora.shrink_rows  # a shrink that forgets the norm gives another step

    def unnormed(layer, matrix, x, idx, norm=None, is_shrunk=False):
        return shrink(layer, matrix, x, idx, None, is_shrunk)

    monkeypatch.setattr(lora, "shrink_rows", unnormed)
    assert not _close(_step(forward, slots, per_row=True, fused=True)[1:], want[1:])


@pytest.mark.parametrize("slots", [[2, 0, 3], [1, 0, 3, 3, 2, 1]])
def test_unfused_decode_step_by_row_slots_matches_the_grouped_one(adapters, request, forward,
                                                                  slots):
    """cuBLAS products with per-row (3 rows) or grouped (6 rows) kernels, gate/up's term
    and SiLU gate in one kernel."""
    if rerun_interpreted(request):
        return
    want = _step(forward, slots, per_row=False, fused=False)
    got = _step(forward, slots, per_row=True, fused=False)
    assert _close(got, want)


@pytest.mark.parametrize("slots", [[3], [0, 1, 3, 1, 0, 2, 2],
                                   [(i * 7) % 5 % 4 for i in range(37)]])
def test_gate_rows_add_the_terms_before_the_silu_gate_and_shrink_for_down(stories, adapters,
                                                                          request, slots):
    if rerun_interpreted(request):
        return
    cfg = stories.config
    lora, grouped = _lora(cfg, adapters, "triton"), _lora(cfg, adapters, "grouped")
    lora.reserve(len(slots))
    n, f = len(slots), cfg.intermediate_size
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, cfg.hidden_size, generator=gen)
    gate_up = torch.randn(n, 2 * f, generator=gen)
    got = torch.empty(n, f)
    idx = torch.tensor(slots, dtype=torch.int32)
    groups = grouped.groups(slots, [1] * n)
    lora.begin_rows(idx)
    lora.gate_rows(2, x, gate_up, got, idx)
    want = gate_up.clone()
    grouped.add(2, "gate_up", x, want, groups)
    assert _close(got, _silu_gate(want))
    on_adapter = [i for i, k in enumerate(slots) if k]
    assert not _close(got[on_adapter], _silu_gate(gate_up)[on_adapter])
    # down's shrink ran with it: its expand alone gives down's terms of the gate's output
    res = torch.randn(n, cfg.hidden_size, generator=gen)
    down, want_down = res.clone(), res.clone()
    lora.add_rows(2, "down", got, down, idx, is_shrunk=True)
    grouped.add(2, "down", got, want_down, groups)
    assert _close(down, want_down)
    assert not _close(down[on_adapter], res[on_adapter])


@pytest.mark.parametrize("hidden_layer", [2, -1])
def test_grouped_step_captures_hidden_states_with_every_term_added(stories, adapters, request,
                                                                   hidden_layer):
    """The hidden states a grouped decode step stages between two layers (or after the
    final norm) hold every LoRA term of the layers before."""
    if rerun_interpreted(request):
        return
    cfg = stories.config
    plan = EnginePlan(max_batch=6, max_seq=8, page_size=4, num_pages=12, prefill_chunk=8,
                      hidden_layer=hidden_layer)
    state = allocate_state(cfg, plan, CPU, torch.float32, has_wide_scratch=False,
                           fused_rows=0)
    forward = Forward(cfg, load_weights(stories.weights, cfg, CPU, torch.float32),
                      TorchOps(cfg, plan.page_size), state, hidden_layer, plan.page_size, True,
                      lora=_lora(cfg, adapters, "triton"))
    slots = [1, 0, 3, 3, 2, 1]
    n = len(slots)
    ids = torch.tensor([7 + 5 * i for i in range(n)], dtype=torch.int32)
    positions = torch.zeros(n, dtype=torch.int32)
    tables = (torch.arange(n)[:, None] * 2 + torch.arange(2)[None, :]).int()
    assert forward.lora is not None
    forward.decode(n, ids, positions, tables, True, forward.lora.groups(slots, [1] * n))
    want = state.cap_state[:n].clone(), state.logits[:n].clone()
    forward.decode(n, ids, positions, tables, True,
                   lora_slots=torch.tensor(slots, dtype=torch.int32))
    assert _close(state.cap_state[:n], want[0])
    assert _close(state.logits[:n], want[1])
