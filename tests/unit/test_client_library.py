"""llm_stage_client against a fake orchestrator on a loopback port: the requests it builds, the
events it returns, deadlines, error mapping, cancel/topology, the asyncio client and the CLI."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from llm_stage_client import AsyncClient, Client, Delta, FinalReport, StageClientError, cli
from llm_stage_client.cli import main
from llm_stage_client.controls import TokenLogprob
from llm_stage_client.types import build_generate_request, finish_reason_name

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb

# (stage, port, token ids, text): the text and tokens ports of one stage carry the same text.
DELTAS = [("backbone", "text", [5, 6], "Once"), ("backbone", "tokens", [5, 6], "Once"),
          ("backbone", "text", [7], " upon"), ("backbone", "tokens", [7], " upon")]
DIAGNOSTICS = {"backbone": {"seed": 7, "engine": "numpy"}}


def bounded_by(remaining: float | None, timeout: float) -> bool:
    """Whether the server saw a deadline of about `timeout` seconds at most. The slack: grpc
    rounds the timeout it sends up to a few significant digits, and its server clock reads ~10 ms
    past the client's."""
    return remaining is not None and 0.0 < remaining <= timeout * 1.01 + 0.05


def _scored(token: int, top: int) -> pb.TokenLogprob:
    """Token t's log-probability is -t/8 (exact in float32); its alternatives t, t+1, ...
    (k of them)."""
    return pb.TokenLogprob(token_id=token, logprob=-token / 8,
                           top_ids=[token + i for i in range(top)],
                           top_logprobs=[-(token + i) / 8 for i in range(top)])


class FakeOrchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    """Records each GenerateRequest and its deadline; answers with canned events (with
    log-probabilities when asked: the prompt's on the first delta of each port). Prompt
    "overload" is RESOURCE_EXHAUSTED, prompt "fail" ends with finish reason ERROR."""

    def __init__(self) -> None:
        self.requests: list[opb.GenerateRequest] = []
        self.remaining: list[float | None] = []

    def Generate(self, request: opb.GenerateRequest, context: Any) -> Iterator[opb.GenerateEvent]:
        self.requests.append(request)
        self.remaining.append(context.time_remaining())
        text = request.request.text
        if text == "overload":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "admission queue is full")
        asked = request.request
        for i, (stage, port, ids, delta_text) in enumerate(DELTAS):
            if not request.sinks or f"{stage}:{port}" in request.sinks:
                delta = opb.Delta(stage_id=stage, port=port, token_ids=ids, text=delta_text)
                if asked.HasField("logprobs"):
                    delta.logprobs.extend(_scored(t, asked.logprobs) for t in ids)
                if asked.HasField("prompt_logprobs") and i < 2:
                    delta.prompt_logprobs.extend(_scored(t, asked.prompt_logprobs)
                                                 for t in (2, 3))
                yield opb.GenerateEvent(delta=delta)
        failed = text == "fail"
        final = opb.FinalReport(
            request_id=request.request.request_id or "req-1",
            finish_reason=pb.FINISH_REASON_ERROR if failed else pb.FINISH_REASON_MAX_LENGTH,
            error="stage died" if failed else "", route=["backbone"],
            usage=opb.Usage(prompt_tokens=3, completion_tokens=2))
        final.diagnostics.update(DIAGNOSTICS)
        yield opb.GenerateEvent(final=final)

    def Cancel(self, request: opb.CancelGenerateRequest,
               context: Any) -> opb.CancelGenerateResponse:
        return opb.CancelGenerateResponse(found=request.request_id == "known")

    def Topology(self, request: opb.TopologyRequest, context: Any) -> opb.TopologyResponse:
        replica = opb.ReplicaInfo(endpoint="127.0.0.1:50051", healthy=True)
        stage = opb.StageInfo(id="backbone", runner="llm.backbone", emits=["text", "tokens"],
                              replicas=[replica])
        return opb.TopologyResponse(stages=[stage], sinks=["backbone:text", "backbone:tokens"],
                                    default_sinks=["backbone:text"], max_running=8, max_queued=32)


@pytest.fixture
def orch() -> Iterator[tuple[FakeOrchestrator, str]]:
    fake = FakeOrchestrator()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(None)


def test_request_fields_from_kwargs(orch: tuple[FakeOrchestrator, str]) -> None:
    fake, target = orch
    with Client(target) as client:
        client.generate_text("Hi", temperature=0.0, seed=3, stop=["\n", "."], request_id="r1",
                             sinks=["backbone:text"], ignore_eos=True)
        req = fake.requests[-1]
        assert req.request.WhichOneof("prompt") == "text" and req.request.text == "Hi"
        sampling = req.request.sampling
        # Set only when given: temperature 0 is a value, not "unset".
        assert sampling.HasField("temperature") and sampling.temperature == 0.0
        assert sampling.HasField("seed") and sampling.seed == 3
        assert not any(sampling.HasField(f) for f in ("top_k", "top_p", "max_tokens"))
        assert list(req.request.stop) == ["\n", "."] and list(req.sinks) == ["backbone:text"]
        assert req.request.request_id == "r1" and req.request.ignore_eos

        client.generate_text(token_ids=[1, 2, 3], top_k=4, top_p=0.5, max_tokens=9)
        req = fake.requests[-1]
        assert req.request.WhichOneof("prompt") == "token_ids"
        assert list(req.request.token_ids.ids) == [1, 2, 3]
        assert (req.request.sampling.top_k, req.request.sampling.top_p,
                req.request.sampling.max_tokens) == (4, 0.5, 9)
        assert not req.request.sampling.HasField("temperature")
        assert not req.sinks and not req.request.stop and not req.request.ignore_eos

        client.generate_text(messages=[("system", "Be brief."), ("user", "Hi")])
        req = fake.requests[-1]
        assert req.request.WhichOneof("prompt") == "messages"
        assert [(m.role, m.content) for m in req.request.messages.messages] == [
            ("system", "Be brief."), ("user", "Hi")]
        assert req.request.sampling.ListFields() == []


def test_exactly_one_prompt_fails_before_calling(orch: tuple[FakeOrchestrator, str]) -> None:
    fake, target = orch
    with Client(target) as client:
        with pytest.raises(ValueError, match="exactly one"):
            client.generate()
        with pytest.raises(ValueError, match="prompt, token_ids"):
            client.generate("Hi", token_ids=[1])
        with pytest.raises(ValueError):
            client.generate_text(token_ids=[1], messages=[("user", "Hi")])
        with pytest.raises(TypeError):
            client.generate("Hi", stop="\n")
    assert fake.requests == []


def test_events_convert_to_library_types(orch: tuple[FakeOrchestrator, str]) -> None:
    _, target = orch
    with Client(target) as client:
        items = list(client.generate("Hi"))
        text, report = client.generate_text("Hi", sinks=["backbone:text"])
    assert items[0] == Delta("backbone", "text", (5, 6), "Once")
    assert items[1] == Delta("backbone", "tokens", (5, 6), "Once")
    assert len(items) == 5 and items[-1] == report
    # Struct numbers come back as floats.
    assert report == FinalReport(request_id="req-1", finish_reason="max_length", error="",
                                 prompt_tokens=3, completion_tokens=2,
                                 diagnostics={"backbone": {"seed": 7.0, "engine": "numpy"}},
                                 route=("backbone",))
    assert text == "Once upon"
    assert [finish_reason_name(v) for v in range(6)] == [
        "", "end_of_sequence", "max_length", "stop_words", "cancelled", "error"]


def test_deadline_is_passed(orch: tuple[FakeOrchestrator, str]) -> None:
    fake, target = orch
    with Client(target) as client:
        client.generate_text("Hi")
    # Without a deadline grpc's sync server reports an effectively infinite time, not None.
    assert fake.remaining[-1] is None or fake.remaining[-1] > 1e6
    with Client(target, timeout=30.0) as client:
        client.generate_text("Hi")
        default = fake.remaining[-1]
        client.generate_text("Hi", timeout=5.0)
        override = fake.remaining[-1]
    assert bounded_by(default, 30.0) and not bounded_by(default, 5.0)
    assert bounded_by(override, 5.0)


def test_errors_map_to_stage_client_error(orch: tuple[FakeOrchestrator, str]) -> None:
    _, target = orch
    with Client(target) as client, pytest.raises(StageClientError) as err:
        client.generate_text("overload")
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert err.value.message == "admission queue is full"
    with Client("127.0.0.1:1", timeout=5.0) as client, pytest.raises(StageClientError) as err:
        client.topology()
    assert err.value.code == "UNAVAILABLE"


def test_cancel_and_topology(orch: tuple[FakeOrchestrator, str]) -> None:
    _, target = orch
    with Client(target) as client:
        assert client.cancel("known") is True
        assert client.cancel("other") is False
        topo = client.topology()
    assert topo["stages"][0]["id"] == "backbone"
    assert topo["stages"][0]["replicas"][0]["healthy"] is True
    assert topo["default_sinks"] == ["backbone:text"]
    assert (topo["max_running"], topo["max_queued"], topo["running"], topo["queued"]) == (
        8, 32, 0, 0)


def test_async_client(orch: tuple[FakeOrchestrator, str]) -> None:
    fake, target = orch

    async def run() -> None:
        async with AsyncClient(target, timeout=30.0) as client:
            items = [item async for item in client.generate("Hi", temperature=0.5, timeout=5.0)]
            text, report = await client.generate_text("Hi", sinks=["backbone:text"])
            assert items[0] == Delta("backbone", "text", (5, 6), "Once")
            assert items[-1] == report and report.finish_reason == "max_length"
            assert text == "Once upon"
            with pytest.raises(ValueError):
                client.generate()
            with pytest.raises(StageClientError) as err:
                await client.generate_text("overload")
            assert err.value.code == "RESOURCE_EXHAUSTED"
            assert await client.cancel("known") is True
            assert (await client.topology())["sinks"] == ["backbone:text", "backbone:tokens"]

    asyncio.run(run())
    first, second = fake.remaining[:2]
    assert bounded_by(first, 5.0)
    assert bounded_by(second, 30.0) and not bounded_by(second, 5.0)
    assert fake.requests[0].request.sampling.temperature == 0.5


def test_cli_generate(orch: tuple[FakeOrchestrator, str], capsys: pytest.CaptureFixture[str],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake, target = orch
    monkeypatch.setenv("LLM_STAGE_TARGET", target)
    assert main(["generate", "--temperature", "0", "--max-tokens", "4", "--stop", "x",
                 "--stop", "y", "--timeout", "5", "--request-id", "cli-1", "Hi"]) == 0
    out, err = capsys.readouterr()
    assert out == "Once upon\n"  # the first sink only: the tokens port's text is not doubled
    report = json.loads(err.strip().splitlines()[-1])
    assert report["finish_reason"] == "max_length" and report["request_id"] == "cli-1"
    assert report["diagnostics"] == {"backbone": {"seed": 7, "engine": "numpy"}}
    req = fake.requests[-1].request
    assert req.text == "Hi" and list(req.stop) == ["x", "y"]
    assert req.sampling.temperature == 0.0 and req.sampling.max_tokens == 4
    assert not req.sampling.HasField("seed")
    assert bounded_by(fake.remaining[-1], 5.0)

    assert main(["generate", "--target", target, "fail"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(err.strip().splitlines()[-1])["error"] == "stage died"

    assert main(["generate", "--target", target, "overload"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "llm-stage: RESOURCE_EXHAUSTED: admission queue is full" in err


class _Exec(Exception):
    """Raised in place of os.execve, with what it was asked to run."""


def _fake_execve(path: str, argv: list[str], env: dict[str, str]) -> None:
    raise _Exec(path, argv, env)


def test_up_hands_every_argument_to_llm_runner_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "execve", _fake_execve)
    with pytest.raises(_Exec) as info:
        main(["up", "--topology", "t.json", "--port", "0", "--help"])
    path, argv, env = info.value.args
    assert (path, argv) == (sys.executable, [sys.executable, "-m", "llm_runner_svc", "up",
                                             "--topology", "t.json", "--port", "0", "--help"])
    assert env["LLM_RUNNER_PROG"] == "llm-stage"  # its usage and messages name llm-stage


def test_up_without_the_server_package_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == cli.SERVER_PACKAGE else real(name, *a))
    monkeypatch.setattr(os, "execve", _fake_execve)
    assert main(["up", "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith("llm-stage: FAILED_PRECONDITION: `llm-stage up` starts the servers")
    assert "pip install llm-runner-svc" in err


def test_images_and_chat_parts(tmp_path) -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"rest"
    file = tmp_path / "photo.jpg"
    file.write_bytes(b"\xff\xd8\xff\xe0jpeg")
    req = build_generate_request(messages=[("user", [1, "compare", 0]), ("assistant", "ok")],
                                 images=[png, str(file), ("image/webp", b"RIFF")]).request
    assert [(m.mime_type, m.data) for m in req.media] == [
        ("image/png", png), ("image/jpeg", b"\xff\xd8\xff\xe0jpeg"), ("image/webp", b"RIFF")]
    parts = req.messages.messages[0].parts
    assert [p.WhichOneof("part") for p in parts] == ["image", "text", "image"]
    assert (parts[0].image, parts[1].text, parts[2].image) == (1, "compare", 0)
    assert req.messages.messages[1].content == "ok"
    assert build_generate_request(prompt="x", images=[b"GIF89a"]).request.media[0].mime_type \
        == "application/octet-stream"
    with pytest.raises(TypeError, match="sequence of images"):
        build_generate_request(prompt="x", images=png)  # type: ignore[arg-type]


def test_structured_output_penalties_and_logprobs_from_kwargs() -> None:
    req = build_generate_request(prompt="x", presence_penalty=0.5, frequency_penalty=-0.5,
                                 repetition_penalty=1.2, min_p=0.05, logprobs=3,
                                 prompt_logprobs=0, json_schema={"type": "object"}).request
    s = req.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.min_p) == pytest.approx((0.5, -0.5, 0.05))
    assert s.repetition_penalty == pytest.approx(1.2)
    assert not any(s.HasField(f) for f in ("temperature", "top_k", "top_p", "max_tokens"))
    assert (req.logprobs, req.prompt_logprobs) == (3, 0)
    assert json.loads(req.structured_output.json_schema) == {"type": "object"}
    plain = build_generate_request(prompt="x").request
    assert not plain.HasField("logprobs") and not plain.HasField("prompt_logprobs")
    assert not plain.HasField("structured_output") and plain.sampling.ListFields() == []
    kinds = {"json_schema": '{"type": "string"}', "json_object": True, "regex": "[0-9]+",
             "grammar": 'start: "a"', "choice": ["yes", "no"]}
    for kind, value in kinds.items():
        so = build_generate_request(prompt="x", **{kind: value}).request.structured_output
        assert so.WhichOneof("kind") == kind
    assert list(build_generate_request(prompt="x", choice=("a", "b")).request
                .structured_output.choice.choices) == ["a", "b"]
    with pytest.raises(ValueError, match=r"at most one structured output \(got regex, json_obj"):
        build_generate_request(prompt="x", json_object=True, regex="a")
    with pytest.raises(ValueError, match="regex, choice"):
        build_generate_request(prompt="x", regex="a", choice=["a"])
    with pytest.raises(TypeError, match="choice takes a sequence"):
        build_generate_request(prompt="x", choice="yes")


def test_deltas_carry_one_logprob_per_token(orch: tuple[FakeOrchestrator, str]) -> None:
    _, target = orch
    with Client(target) as client:
        items = list(client.generate("Hi", logprobs=2, prompt_logprobs=1,
                                     sinks=["backbone:text"]))
        plain = list(client.generate("Hi", sinks=["backbone:text"]))
    deltas = [d for d in items if isinstance(d, Delta)]
    assert [[lp.token_id for lp in d.logprobs] for d in deltas] == \
        [list(d.token_ids) for d in deltas] == [[5, 6], [7]]
    assert deltas[0].logprobs[0] == TokenLogprob(5, -0.625, ((5, -0.625), (6, -0.75)))
    assert [lp.token_id for lp in deltas[0].prompt_logprobs] == [2, 3]
    assert not deltas[1].prompt_logprobs
    assert deltas[0].prompt_logprobs[1].top == ((3, -0.375),)
    assert all(not d.logprobs and not d.prompt_logprobs for d in plain
               if isinstance(d, Delta))


def test_cli_structured_output_penalties_and_logprobs(
        orch: tuple[FakeOrchestrator, str], capsys: pytest.CaptureFixture[str],
        tmp_path) -> None:
    fake, target = orch
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    assert main(["generate", "--target", target, "--json-schema", str(schema),
                 "--presence-penalty", "0.5", "--frequency-penalty", "0.25",
                 "--repetition-penalty", "1.1", "--min-p", "0.05", "--logprobs", "2",
                 "--prompt-logprobs", "0", "Hi"]) == 0
    out, err = capsys.readouterr()
    assert out == "Once upon\n"
    report = json.loads(err.strip().splitlines()[-1])
    # one per token of the text shown, the alternatives as {"token_id", "logprob"}
    assert [lp["token_id"] for lp in report["logprobs"]] == [5, 6, 7]
    assert report["logprobs"][0] == {"token_id": 5, "logprob": -0.625,
                                     "top": [{"token_id": 5, "logprob": -0.625},
                                             {"token_id": 6, "logprob": -0.75}]}
    assert [lp["token_id"] for lp in report["prompt_logprobs"]] == [2, 3]
    assert "top" not in report["prompt_logprobs"][0]  # K 0: the token's own only
    assert TokenLogprob(1, -0.6000000238).as_dict(6) == {"token_id": 1, "logprob": -0.6}
    req = fake.requests[-1].request
    assert req.structured_output.json_schema == '{"type": "object"}'
    assert (req.sampling.presence_penalty, req.sampling.frequency_penalty) == (0.5, 0.25)
    assert req.sampling.repetition_penalty == pytest.approx(1.1)
    assert req.sampling.min_p == pytest.approx(0.05)
    assert (req.logprobs, req.prompt_logprobs) == (2, 0)

    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"')
    cases = [(["--json-schema", '{"type": "string"}'], "json_schema", '{"type": "string"}'),
             (["--json-object"], "json_object", True), (["--regex", "[a-z]+"], "regex", "[a-z]+"),
             (["--grammar", str(grammar)], "grammar", 'start: "yes" | "no"')]
    for flags, kind, value in cases:
        assert main(["generate", "--target", target, *flags, "Hi"]) == 0
        so = fake.requests[-1].request.structured_output
        assert so.WhichOneof("kind") == kind and getattr(so, kind) == value
    assert main(["generate", "--target", target, "--choice", "yes", "--choice", "no", "Hi"]) == 0
    assert list(fake.requests[-1].request.structured_output.choice.choices) == ["yes", "no"]
    err = capsys.readouterr().err
    assert "logprobs" not in err.strip().splitlines()[-1]  # none asked: no key

    num_sent = len(fake.requests)
    assert main(["generate", "--target", target, "--json-schema", "schema.jsn", "Hi"]) == 2
    assert "--json-schema: 'schema.jsn' is neither a file nor a JSON schema" in \
        capsys.readouterr().err
    assert main(["generate", "--target", target, "--grammar", str(tmp_path / "no"), "Hi"]) == 2
    assert "INVALID_ARGUMENT: --grammar:" in capsys.readouterr().err
    assert len(fake.requests) == num_sent  # nothing sent
    with pytest.raises(SystemExit):  # two constraints: argparse says so
        main(["generate", "--target", target, "--regex", "a", "--json-object", "Hi"])
