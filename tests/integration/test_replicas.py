"""Two runner replicas; one is killed in the middle of a load run."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from deployment import Deployment, collect, generate_request
from helpers import solo

from llm_runner_svc.models import Model


def test_killing_a_replica_fails_only_its_requests(tmp, stories: Model) -> None:
    dep = Deployment(tmp, {"backbone": {"maxSeq": 512}}, replicas=2)
    try:
        victim = dep.all_stages[0]
        spec = dict(text="Once upon a time", temperature=0.8, max_tokens=400, ignore_eos=True)

        def one(i: int) -> tuple[str, object]:
            s = dict(spec, seed=i)
            call = dep.stub.Generate(generate_request(s.pop("text"), **s), timeout=60)
            try:
                return "ok", collect(call)
            except grpc.RpcError as exc:
                return exc.code().name, exc.details()

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(one, i) for i in range(16)]
            while victim.stats()["steps"] < 20:  # both replicas are busy by now
                pass
            victim.kill()
            results = [f.result() for f in futures]
        failed = [r for r in results if r[0] != "ok"]
        assert failed, "the killed replica had requests in flight"
        assert all(code == "UNAVAILABLE" and victim.endpoint in msg for code, msg in failed)
        for i, (status, out) in enumerate(results):
            if status == "ok":
                assert out[0] == solo(stories, dict(spec, seed=i))[0]
        assert len(failed) < 16  # the other replica's requests finished
        # later requests all succeed on the survivor
        later = [collect(dep.stub.Generate(generate_request("The dog", max_tokens=8, seed=j),
                                           timeout=30)) for j in range(8)]
        assert all(final.usage.completion_tokens == 8 for _, _, final in later)
        topo = dep.topology()["stages"][0]["replicas"]
        assert [r["healthy"] for r in topo] == [False, True]
        assert dep.all_stages[1].wait_idle()["slots"] == 0
    finally:
        dep.close()
