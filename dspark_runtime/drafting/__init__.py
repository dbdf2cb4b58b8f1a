"""Drafters: the interface the loop drives, n-gram lookup, a standalone draft LM, the DSpark drafter, the
router between them, Sequential Temperature Scaling of the confidence head, and the engine's drafter choice."""
