"""The exporter's graph: the IO contract with and without the hidden port, and every dtype
passing onnx.checker with the weights stored in that dtype."""

from __future__ import annotations

import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra")

from llm_runner_svc.errors import InvalidArgument  # noqa: E402
from llm_runner_svc.export import signature as sig  # noqa: E402
from llm_runner_svc.export.decoder import ExportOptions, export_decoder  # noqa: E402
from llm_runner_svc.export.signature import GraphDtype  # noqa: E402

ELEM = {GraphDtype.FP32: onnx.TensorProto.FLOAT, GraphDtype.FP16: onnx.TensorProto.FLOAT16,
        GraphDtype.BF16: onnx.TensorProto.BFLOAT16}


@pytest.mark.parametrize("dtype", list(GraphDtype))
def test_every_dtype_passes_the_checker_with_kv_in_that_dtype(stories, dtype):
    model = export_decoder(stories.config, stories.weights, ExportOptions(dtype))
    onnx.checker.check_model(model, full_check=True)
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input,
                                                             *model.graph.output)}
    assert types[sig.past_key(0)] == types[sig.new_value(4)] == ELEM[dtype]
    assert types[sig.LOGITS] == types[sig.ATTENTION_BIAS] == onnx.TensorProto.FLOAT
    emb = next(t for t in model.graph.initializer if t.name.startswith("embedding"))
    assert emb.data_type == ELEM[dtype]


def test_hidden_outputs_exist_only_with_a_hidden_layer(stories):
    c = stories.config
    plain = export_decoder(c, stories.weights)
    hidden = export_decoder(c, stories.weights, ExportOptions(hidden_layer=2))
    plain_out = [o.name for o in plain.graph.output]
    assert plain_out == [sig.LOGITS] + [n for i in range(c.num_layers)
                                        for n in (sig.new_key(i), sig.new_value(i))]
    assert [o.name for o in hidden.graph.output] == plain_out + [sig.HIDDEN_EMBED,
                                                                  sig.HIDDEN_STATE]
    with pytest.raises(InvalidArgument, match="accept_hidden_layer"):
        export_decoder(c, stories.weights, ExportOptions(hidden_layer=c.num_layers + 1))
