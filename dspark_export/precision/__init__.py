"""Precision: int4/int8 MatMulNBits, INT8 and FP8 QDQ with their activation ranges, and the precision
step's accuracy checks."""
