"""Precision: the engine precisions and the quantizer of each (int4 MatMulNBits, INT8 and FP8 QDQ with their
activation ranges, ONNX Runtime's dynamic INT8), and the precision step's accuracy checks.
"""
