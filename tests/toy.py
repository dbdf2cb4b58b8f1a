"""Toy pieces for testing the decoding core without models: a bigram target with the one-sequence runner interface
and the no-op request hooks of a drafter."""
import numpy as np

from dspark_runtime.drafting.base import Drafter
from dspark_runtime.runners.base import BatchRunner, SequenceDecoder


class BigramTarget(SequenceDecoder):
    """A toy target (a one-sequence runner, :class:`SequenceDecoder`): next-token logits = log T[last token]."""

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


class StatelessDrafter(Drafter):
    """The request hooks of a drafter that keeps no per-request state (subclasses add ``propose_batch``)."""

    def begin(self, req):
        pass

    def remove(self, rid):
        pass



class BigramBook(BatchRunner):
    """A toy batched runner (the :class:`~dspark_runtime.runners.base.BatchRunner` interface) over the bigram table: any
    number of requests, packed rows (``pass_rows`` = tokens in the call); ``calls`` records each ``step``'s
    segments as (rid, token count) pairs."""

    def __init__(self, table):
        super().__init__()
        self.logt = np.log(np.asarray(table, dtype=np.float64)).astype(np.float32)
        self.calls = []

    def add(self, rid):
        self._length[rid] = 0

    def remove(self, rid):
        self._length.pop(rid, None)

    def rollback(self, rid, length):
        self._check_rollback(rid, length)
        self._length[rid] = length

    def step(self, segments):
        self._check_segments(segments)
        self.calls.append([(rid, len(t)) for rid, t in segments])
        for rid, t in segments:
            self._length[rid] += len(t)
        return [self.logt[np.asarray(t)] for _, t in segments]
