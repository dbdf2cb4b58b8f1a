"""ONNX graphs: tracing a decoder with an explicit KV cache and validating it against torch, the external
data writer, the capacity layout and half precision, device graphs and their fusions."""
