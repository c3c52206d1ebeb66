"""A verify step run as decode rows (the torch engine: K + 1 decode rows per verify row, one
decode step for the whole step) gives the picks, logits and KV of the prefill-pass path it
replaces, with the reference ops and with the Triton kernels (Triton's interpreter, float32,
on the CPU, against the prefill path on the reference ops: the prefill attention kernel does
not run in the interpreter); and the decode attention of that step (`stores_kv=False`)
writes nothing, so the k and v its rows read are the ones stored before it launched."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import rerun_interpreted  # noqa: E402

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.base import EnginePlan  # noqa: E402
from llm_runner_svc.engines.batch import Batch, Row, SampleSpec  # noqa: E402
from llm_runner_svc.engines.torch_graphs import verify_buckets  # noqa: E402
from llm_runner_svc.engines.torch_ops import Rope, TorchOps, pool_slots  # noqa: E402

GREEDY = SampleSpec(0.0, 0, 1.0)
PAGES = ([0, 1], [2], [3, 4])  # each sequence's pages (page size 8)
PROMPTS = ([5, 9, 14, 3, 22, 7, 1, 30, 41, 2], [8, 6, 19, 4, 11], [13, 27, 3, 9, 50, 6, 18])


def _engine(stories, kernels: str, verify_tokens: int, device: str = "cpu"):
    eng = create_engine("torch", stories.config, stories.weights, device=device,
                        kernels=kernels, dtype="float32")
    eng.preallocate(EnginePlan(max_batch=3, max_seq=64, page_size=8, num_pages=24,
                               verify_tokens=verify_tokens))
    return eng


def _prompts(eng, by_decodes: bool) -> list[int]:
    """The prompts' KV, in one prefill step or (`by_decodes`) a decode step per position;
    the pick after each prompt."""
    if not by_decodes:
        out = eng.read(eng.launch(Batch([Row(tuple(p), 0, pages, GREEDY)
                                         for p, pages in zip(PROMPTS, PAGES, strict=True)])))
        return [int(t) for t in out.picks]
    firsts = [0] * len(PROMPTS)
    for i in range(max(map(len, PROMPTS))):
        which = [j for j, p in enumerate(PROMPTS) if i < len(p)]
        out = eng.read(eng.launch(Batch([Row((PROMPTS[j][i],), i, PAGES[j], GREEDY)
                                         for j in which])))
        for j, pick in zip(which, out.picks, strict=True):
            firsts[j] = int(pick)
    return firsts


def _steps(eng, by_decodes: bool = False) -> tuple[list, np.ndarray, list, np.ndarray, int]:
    """The prompts, then a step of a decode row, a greedy verify row (K = 3) and a sampled
    one (K = 2), then a decode step after each: (picks, logits, verified of the verify step;
    the next step's logits; how many decode steps ran rows of one sequence)."""
    runs = []
    decode = eng.forward.decode

    def counted(*args, **kw):
        runs.append(kw.get("stores_first", False))
        return decode(*args, **kw)

    eng.forward.decode = counted
    a, b, c = _prompts(eng, by_decodes)
    hot = SampleSpec(0.9, 0, 1.0, uniform=0.3, accept_uniform=0.6)
    samples = (SampleSpec(0.9, 0, 1.0, uniform=0.7, accept_uniform=0.2),
               SampleSpec(0.9, 0, 1.0, uniform=0.1, accept_uniform=0.9))
    rows = [Row((b,), 5, PAGES[1], GREEDY),  # the scheduler puts decodes first
            Row((a, 17, 4, 33), 10, PAGES[0], GREEDY, verify=3),
            Row((c, 12, 40), 7, PAGES[2], hot, verify=2, verify_samples=samples)]
    out = eng.read(eng.launch(Batch(rows)))
    logits = eng.logits(3)
    nxt = [Row((int(out.picks[0]),), 6, PAGES[1], GREEDY),
           Row((int(out.picks[1]),), 14, PAGES[0], GREEDY),
           Row((int(out.picks[2]),), 10, PAGES[2], GREEDY)]
    eng.read(eng.launch(Batch(nxt)))
    return (list(out.picks), logits, [list(v) if v is not None else None
                                      for v in out.verified], eng.logits(3), runs.count(True))


def _same_as_prefill_path(stories, kernels: str, device: str = "cpu",
                          tol: float = 1e-4) -> None:
    by_decodes = kernels == "triton" and device == "cpu"
    # the plan without verify rows: 8 rows > 3, the prefill passes
    old = _steps(_engine(stories, "torch" if device == "cpu" else kernels, 0, device),
                 by_decodes)
    new = _steps(_engine(stories, kernels, 3, device), by_decodes)
    assert old[4] == 0 and new[4] == (1 if device == "cpu" else 0)  # (CUDA: graphs)
    assert new[0] == old[0] and new[2] == old[2]
    assert new[2][1] is not None and len(new[2][1]) == 3 and len(new[2][2]) == 2
    np.testing.assert_allclose(new[1], old[1], rtol=tol, atol=tol)
    np.testing.assert_allclose(new[3], old[3], rtol=tol, atol=tol)  # the KV it wrote


def test_verify_rows_as_decode_rows_match_the_prefill_path(stories):
    _same_as_prefill_path(stories, "torch")


def test_verify_rows_as_decode_rows_match_the_prefill_path_on_triton_kernels(stories,
                                                                                request):
    if not rerun_interpreted(request):
        _same_as_prefill_path(stories, "triton")


def test_a_short_row_runs_as_decode_rows_too(stories):
    """A row of up to the plan's K + 1 tokens that verifies nothing (a draft's catch-up
    row): the same pick, logits and KV as through a prefill pass."""
    def steps(eng):
        a, b, _ = _prompts(eng, by_decodes=False)
        calls = []
        decode = eng.forward.decode
        eng.forward.decode = lambda *args, **kw: calls.append(kw.get("stores_first")) or \
            decode(*args, **kw)
        out = eng.read(eng.launch(Batch([Row((a,), 10, PAGES[0], GREEDY),
                                         Row((b, 21), 5, PAGES[1], GREEDY)])))
        logits = eng.logits(2)
        eng.read(eng.launch(Batch([Row((int(out.picks[0]),), 11, PAGES[0], GREEDY),
                                   Row((int(out.picks[1]),), 7, PAGES[1], GREEDY)])))
        return list(out.picks), logits, eng.logits(2), calls.count(True)

    old, new = steps(_engine(stories, "torch", 0)), steps(_engine(stories, "torch", 2))
    assert (old[3], new[3]) == (0, 1)
    assert new[0] == old[0]
    np.testing.assert_allclose(new[1], old[1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(new[2], old[2], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verify_rows_as_decode_rows_match_the_prefill_path_on_gpu(stories, monkeypatch):
    """On CUDA, float32: the verify variant of the decode graphs against the prefill
    graphs; the step replays the verify variant of its bucket."""
    from llm_runner_svc.engines.torch_graphs import DecodeGraphs

    replays = []
    replay = DecodeGraphs.replay

    def counted(self, bucket, with_lora=False, stores_first=False):
        replays.append((bucket, stores_first))
        return replay(self, bucket, with_lora, stores_first)

    monkeypatch.setattr(DecodeGraphs, "replay", counted)
    _same_as_prefill_path(stories, "triton", "cuda", tol=1e-3)
    assert (8, True) in replays  # 8 rows: the verify bucket 3 x 1 < 8 <= 3 x (3 + 1)


def test_decode_attention_without_store_only_reads_the_pool(stories, request):
    """`store_kv` writes what `rope_store` writes; the attention that follows it
    (`stores_kv=False`) leaves the pool as it found it and attends as the reference does,
    while with `stores_kv` it writes the rows' k and v itself: rows of one sequence at
    consecutive positions would then read slots other programs of the same launch write.
    Rows here run in reverse order of position, so a serial interpreter would show that."""
    if rerun_interpreted(request):
        return
    from llm_runner_svc.engines.torch_triton import TritonOps

    c = stories.config
    page, pages_per_seq = 8, 4
    gen = torch.Generator().manual_seed(0)
    pool_rows = 6 * page
    tables = torch.tensor([[1, 3, 0, 5]] * 4, dtype=torch.int32)
    positions = torch.tensor([12, 11, 10, 9], dtype=torch.int32)  # last position first
    qkv = torch.randn(4, c.q_dim + 2 * c.kv_dim, generator=gen)
    pools = (torch.randn(pool_rows, c.kv_dim, generator=gen),
             torch.randn(pool_rows, c.kv_dim, generator=gen))
    cos, sin = (torch.randn(64, c.head_dim // 2, generator=gen) for _ in range(2))
    rope = Rope(cos, sin, None, None)
    ref, tri = TorchOps(c, page), TritonOps(c, page, 1, False)
    tri.reserve(4, pages_per_seq * page, torch.device("cpu"))
    slots = pool_slots(positions, tables, page)

    want_k, want_v = pools[0].clone(), pools[1].clone()
    want_qkv = qkv.clone()
    ref.rope_store(want_qkv, positions, slots, cos, sin, want_k, want_v, None, None)
    want = torch.zeros(4, c.q_dim)
    ref.decode_attention(want_qkv, want_k, want_v, positions, tables, want, rope)

    k, v = pools[0].clone(), pools[1].clone()
    tri.store_kv(qkv, positions, slots, k, v, rope)
    torch.testing.assert_close(k, want_k)
    torch.testing.assert_close(v, want_v)
    ref_k, ref_v = pools[0].clone(), pools[1].clone()
    ref.store_kv(qkv, positions, slots, ref_k, ref_v, rope)
    torch.testing.assert_close(ref_k, want_k)
    stored_k, stored_v = k.clone(), v.clone()
    got = torch.zeros(4, c.q_dim)
    tri.decode_attention(qkv, k, v, positions, tables, got, rope, stores_kv=False)
    assert torch.equal(k, stored_k) and torch.equal(v, stored_v)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    k, v = pools[0].clone(), pools[1].clone()  # the one-launch store: k and v written ...
    tri.decode_attention(qkv, k, v, positions, tables, got, rope)
    torch.testing.assert_close(k, want_k)
    # ... but row 0 (position 12) ran before the rows that store positions 9 .. 11
    assert not torch.allclose(got[0], want[0], rtol=1e-3, atol=1e-3)


def test_verify_buckets_hold_every_step_of_the_plan():
    assert verify_buckets(8, 0) == []
    assert verify_buckets(1, 4) == [5]
    assert verify_buckets(32, 4) == [2, 4, 5, 8, 10, 16, 20, 32, 40, 80, 160]
    assert verify_buckets(12, 3) == [2, 4, 8, 12, 16, 32, 48]
    plan = EnginePlan(max_batch=32, max_seq=64, page_size=8, num_pages=8, verify_tokens=4)
    assert plan.max_decode_rows == verify_buckets(32, 4)[-1]
