"""Loading and unloading LoRA adapters at run time over real gRPC (admin calls): the token
gate, maxLoras, a malformed adapter refused while the stage keeps serving, an adapter in use
refused, a freed slot taking another adapter, and the client library and `llm-stage adapters`
against the same stage."""

from __future__ import annotations

import json

import grpc
import pytest
from helpers import TEST_ENGINE
from llm_stage_client.admin import StageAdmin
from llm_stage_client.cli import main as stage_cli
from llm_stage_client.types import StageClientError
from lora_fixtures import write_adapter
from stage_harness import StageServer
from test_lora_stage import TEXT, _merged_tokens

from llm_runner_svc.admin import ADMIN_TOKEN_ENV
from llm_runner_svc.stage.config import StageConfig
from services.contract.llmstage.v1 import stage_pb2 as pb

TOKEN = "s3cret-admin-token"
ADMIN = (("authorization", f"Bearer {TOKEN}"),)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _run(srv: StageServer, sid: int, lora: str) -> list[int]:
    srv.admit_prepare(sid, text=TEXT, lora=lora, temperature=0.0, max_tokens=10,
                      ignore_eos=True)
    stream = srv.step([sid], credits=64)
    tokens = stream.collect({sid})[sid]["tokens"]
    stream.half_close()
    srv.stub.Finish(pb.FinishRequest(slot_id=sid))
    srv.stub.Reset(pb.ResetRequest(slot_id=sid))
    return tokens


def test_load_and_unload_at_run_time(stories, tmp_path, monkeypatch, capsys):
    if TEST_ENGINE not in ("numpy", "torch"):
        pytest.skip(f"the {TEST_ENGINE} engine serves no LoRA adapters")
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    dirs = {n: write_adapter(tmp_path / n, stories.config, seed=i)
            for i, n in enumerate(("fr", "de", "es"))}
    bad = write_adapter(tmp_path / "bad", stories.config, seed=9)
    meta = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**meta, "r": 2}))
    junk = write_adapter(tmp_path / "junk", stories.config, seed=9)
    (junk / "adapter_model.safetensors").write_bytes(b"not safetensors")
    config = StageConfig(max_seq=256, lora_adapters=(("fr", str(dirs["fr"])),), max_loras=2,
                         prefix_cache=True, adapter_root=str(tmp_path))
    want = {n: _merged_tokens(stories, p, 10) for n, p in dirs.items()}
    with StageServer(config) as srv:
        stub = srv.stub
        desc = stub.Describe(pb.DescribeRequest())
        assert list(desc.lora_adapters) == ["fr"] and desc.max_loras == 2
        load = pb.LoadAdapterRequest(name="de", path="de")  # relative to adapter_root
        assert _code(lambda: stub.LoadAdapter(load)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: stub.LoadAdapter(load, metadata=(
            ("authorization", "Bearer wrong"),))) == grpc.StatusCode.PERMISSION_DENIED
        assert list(stub.LoadAdapter(load, metadata=ADMIN).lora_adapters) == ["fr", "de"]
        assert list(stub.Describe(pb.DescribeRequest()).lora_adapters) == ["fr", "de"]
        assert _run(srv, 1, "de") == want["de"]

        # full, taken, malformed, missing: refused, and the stage serves on
        for request, code in (
                (pb.LoadAdapterRequest(name="es", path="es"), "RESOURCE_EXHAUSTED"),
                (pb.LoadAdapterRequest(name="fr", path="es"), "ALREADY_EXISTS")):
            assert _code(lambda r=request: stub.LoadAdapter(r, metadata=ADMIN)).name == code
        assert _code(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="nope"),
                                                metadata=ADMIN)) == grpc.StatusCode.NOT_FOUND

        # in use: an admitted request on "de" holds it
        assert srv.admit(2, text=TEXT, lora="de").admitted
        unload = pb.UnloadAdapterRequest(name="de")
        with pytest.raises(grpc.RpcError) as info:
            stub.UnloadAdapter(unload, metadata=ADMIN)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "in use by 1" in info.value.details()
        stub.Finish(pb.FinishRequest(slot_id=2))
        stub.Reset(pb.ResetRequest(slot_id=2))
        assert list(stub.UnloadAdapter(unload, metadata=ADMIN).lora_adapters) == ["fr"]
        refused = srv.admit(3, text=TEXT, lora="de")
        assert not refused.admitted and refused.refusal == pb.REFUSAL_UNKNOWN_ADAPTER
        assert "['fr']" in refused.reason

        for name, path in (("bad", bad), ("junk", junk)):
            with pytest.raises(grpc.RpcError) as info:
                stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=str(path)),
                                 metadata=ADMIN)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(path) in info.value.details()
        assert _code(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(
            name="gone", path="no/such/dir"), metadata=ADMIN)) == grpc.StatusCode.NOT_FOUND
        assert _run(srv, 4, "fr") == want["fr"]  # still serving

        # the freed slot takes another adapter through the client library; the same
        # prompt on it must not reuse the pages "de" left in the prefix cache
        with StageAdmin(f"127.0.0.1:{srv.port}", TOKEN) as admin:
            assert admin.load_adapter("es", "es") == ["fr", "es"]
            with pytest.raises(StageClientError) as err:
                admin.load_adapter("x", "es")
            assert err.value.code == "RESOURCE_EXHAUSTED"
        assert _run(srv, 5, "es") == want["es"] != want["de"]
        with pytest.raises(StageClientError) as err:
            StageAdmin(f"127.0.0.1:{srv.port}", None).unload_adapter("es")
        assert err.value.code == "PERMISSION_DENIED"

        assert stage_cli(["adapters", "unload", "es", "--stage",
                          f"127.0.0.1:{srv.port}"]) == 0  # token from the environment
        assert stage_cli(["adapters", "list", "--stage", f"127.0.0.1:{srv.port}"]) == 0
        assert capsys.readouterr().out.split() == ["fr", "fr"]
