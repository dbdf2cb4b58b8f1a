"""The engine directory: the manifest schema and file checks, the graph interfaces, the speculation
section, tarballs, and the tokenizer with its chat template."""
