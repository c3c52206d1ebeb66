"""Export of our model description to an ONNX decoder step, and TensorRT plans built from it.

`decoder` needs the `onnx` package (extra `onnx`); `plan` needs TensorRT or TensorRT-RTX
(extra `tensorrt`). This package's own import pulls in neither, so the CLI can name
`build-engine` on an install without them.
"""
