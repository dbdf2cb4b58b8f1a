"""Backends: a graph file made callable — ONNX Runtime on the CPU and CUDA, TensorRT, the device-memory
capacity decoder they share — and per-graph placement."""
