"""Measured on the deployment machine: the machine record, the row-padding and kernel probes, the round
cost table's profiler, and what loading checks against this machine."""
