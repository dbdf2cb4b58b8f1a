"""Writing engine directories: build, add-draft and TensorRT builds, each through one transaction, and the
manifest's provenance at commit.
"""
