"""Toy pieces for testing the decoding core without models: a bigram target with the one-sequence runner interface
and the no-op request hooks of a drafter."""
import numpy as np


class BigramTarget:
    """A toy target (DecoderRunner interface): next-token logits = log T[last token]."""

    row_multiple = 1
    features = None

    def __init__(self, table):
        self.logt = np.log(np.asarray(table, dtype=np.float64)).astype(np.float32)
        self.tokens = []

    @property
    def length(self):
        return len(self.tokens)

    def reset(self):
        self.tokens = []

    def step(self, tokens):
        self.tokens += list(tokens)
        return self.logt[np.asarray(tokens)]

    def prefill(self, tokens, chunk=None):
        return self.step(tokens)[-1]

    def rollback(self, length):
        self.tokens = self.tokens[:length]


class StatelessDrafter:
    """The request hooks of a drafter that keeps no per-request state (subclasses add ``propose_batch``)."""

    def begin(self, req):
        pass

    def remove(self, rid):
        pass
