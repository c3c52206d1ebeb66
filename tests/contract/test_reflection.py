"""grpcurl-style access: a client with no generated stubs lists the services through
reflection, builds the messages from the served descriptors and calls Describe and Health."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from stage_harness import StageServer

CLIENT = textwrap.dedent("""
    import json, sys
    import grpc
    from google.protobuf import descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)

    channel = grpc.insecure_channel(sys.argv[1])
    db = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(db)
    out = {"services": sorted(db.get_services())}

    def call(service, method, body):
        m = pool.FindServiceByName(service).FindMethodByName(method)
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        rpc = channel.unary_unary(f"/{service}/{method}",
                                  request_serializer=req_cls.SerializeToString,
                                  response_deserializer=resp_cls.FromString)
        return json_format.MessageToDict(rpc(json_format.ParseDict(body, req_cls())))

    out["describe"] = call("llmstage.v1.Stage", "Describe", {})
    out["health"] = call("grpc.health.v1.Health", "Check", {"service": "llmstage.v1.Stage"})
    out["admit"] = call("llmstage.v1.Stage", "Admit",
                        {"slotId": "3", "request": {"text": "Hi", "lora": "x"}})
    out["stubs_imported"] = any(m.startswith("services") for m in sys.modules)
    print(json.dumps(out))
""")


def test_reflection_lists_services_and_calls_describe(server: StageServer) -> None:
    done = subprocess.run([sys.executable, "-c", CLIENT, f"127.0.0.1:{server.port}"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["stubs_imported"] is False
    assert {"llmstage.v1.Stage", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(out["services"])
    d = out["describe"]
    assert d["runner"] == "llm.backbone" and d["model"]["name"] == "stories260K"
    assert d["maxSeq"] == 512 and [p["name"] for p in d["emits"]] == ["text", "tokens"]
    assert out["health"] == {"status": "SERVING"}
    assert out["admit"]["refusal"] == "REFUSAL_UNKNOWN_ADAPTER"  # enums by name, as grpcurl


def test_reflection_v1_answers_as_v1alpha(server: StageServer) -> None:
    # v1's messages are v1alpha's field for field: these bytes are what a v1 client sends
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString)
        listed, found = info(iter([
            rpb.ServerReflectionRequest(list_services=""),
            rpb.ServerReflectionRequest(file_containing_symbol="llmstage.v1.Stage")]),
            timeout=60)
    names = {s.name for s in listed.list_services_response.service}
    assert {"llmstage.v1.Stage", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
            "grpc.reflection.v1.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in found.file_descriptor_response.file_descriptor_proto]
    assert any(svc.name == "Stage" and {m.name for m in svc.method} >= {"Describe", "Admit"}
               for f in files for svc in f.service)
