"""DSpark offline toolchain: fetch real models, export verifier/draft graphs to ONNX, validate,
write the engine manifest."""

__version__ = "0.1.0"
