"""The *scatter* KV layout's runners: one batch row per request, one slot per position (slot p holds position p), the
same graph call for one request or many, and a request's logits bit-identical whatever else shares the call (its keys
are one contiguous block at offset 0 followed by masked slots, exactly what a call of it alone sees; docs/design.md
section 2). Buffers: per layer (key, value) float32 ``[rows, kv_heads, slots, head_dim]``; a call passes the rows it
steps (a view of a contiguous range, else a gathered copy) and writes the returned new entries back at their slots —
unless the graph wrote them into the view itself (slot outputs, :attr:`OrtDecoder.writes_kv_in_place
<dspark_runtime.backends.ort.OrtDecoder.writes_kv_in_place>`; a view is then never passed with another request's row
in it as a dummy row); rolling back only moves a length. Slots grow in steps of :data:`SLOT_STEP`, rows double when requests join. Row
padding: a call's ``batch x Q`` query rows are padded to a multiple of ``row_multiple``
(:mod:`dspark_runtime.machine.row_invariance`) by the cheaper of a longer ``Q`` or dummy batch rows
(:func:`padded_shape`); a request's logits are the same either way. With ``head_skips_padding`` (graphs taking
``logits_to``) the LM head skips the padding positions of a longer ``Q``.
"""
from __future__ import annotations

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.base import PREFILL_CHUNK, BatchRunner, SequenceDecoder

SLOT_STEP = 128  # slots are added in multiples of this many positions


def padded_shape(batch: int, q: int, row_multiple: int) -> tuple:
    """The (batch rows, query rows per batch row) a call of ``batch`` requests with ``q`` query rows each computes:
    the fewest rows ``b * qq`` with ``b >= batch``, ``qq >= q`` and ``b * qq`` a multiple of ``row_multiple`` (ties:
    fewer batch rows, so no dummy row where raising ``qq`` costs the same). Pure function; both searches stay within
    ``row_multiple`` of the start, which always holds the optimum, and the result never falls as ``q`` grows."""
    m = max(1, int(row_multiple))
    best = None
    for b in range(batch, batch + m):
        for qq in range(q, q + m):
            if (b * qq) % m == 0 and (best is None or (b * qq, b) < (best[0] * best[1], best[0])):
                best = (b, qq)
    return best


class ScatterRunner(BatchRunner):
    """Requests' views of one scatter-layout ``causal_lm`` graph (``spec.kv_layout == "scatter"``).

    A :class:`~dspark_runtime.runners.base.BatchRunner`; a single request is a set of one.

    Args:
        backend: an :class:`~dspark_runtime.backends.ort.OrtDecoder` of a scatter-layout graph.
        row_multiple: ``batch * Q`` of every call is padded to a multiple of this (1 = no padding).
        max_slots: refuse to grow a request past this many positions (the graph's context limit), or None.
    Raises DSparkError when the graph is not a scatter-layout causal_lm graph.
    """

    def __init__(self, backend, row_multiple: int = 1, max_slots: int | None = None):
        spec = backend.spec
        if spec.kind != "causal_lm" or spec.kv_layout != "scatter":
            raise DSparkError(f"ScatterRunner needs a scatter-layout causal_lm graph, got {spec.kind}/{spec.kv_layout}; "
                              "re-export the graph with kv_layout='scatter'")
        if int(row_multiple) < 1:
            raise DSparkError(f"row_multiple must be a positive integer (1 = no padding), got {row_multiple!r}")
        super().__init__()
        self.backend = backend
        self.row_multiple = int(row_multiple)
        self.max_slots = max_slots
        d = spec.dims
        self._shape = (d.num_kv_heads, d.head_dim)
        self._layers = d.num_layers
        self._kv = self._alloc(0, 0)
        self._row: dict = {}     # rid -> row
        self._head_skips_padding = False
        self._prompt_backend = None

    @property
    def can_skip_padding_head(self) -> bool:
        """Whether :attr:`head_skips_padding` may be set: the graph takes ``logits_to``."""
        return self.backend.takes_logits_to

    @property
    def head_skips_padding(self) -> bool:
        """The LM head runs on the real query positions of a call padded to a longer ``Q`` only (set it where the
        row probe found the head row-count invariant). Raises DSparkError when set on a graph without ``logits_to``."""
        return self._head_skips_padding

    @head_skips_padding.setter
    def head_skips_padding(self, on: bool) -> None:
        if on and not self.can_skip_padding_head:
            raise DSparkError(f"graph {self.backend.path.name} runs its LM head on every query position (exported "
                              "before the logits_to input); rebuild the engine to skip the padding positions")
        self._head_skips_padding = bool(on)

    @property
    def prompt_backend(self):
        """The backend prompt chunks run on (segments in a call's ``last_only``), or None: the target's. A prompt
        graph (:mod:`dspark_export.precision.prompt_graph`) has the target's interface; a call mixing prompt chunks
        and other segments runs as two calls, so a prompt's positions are computed by the prompt graph whatever
        shares the round. A backend with ``prompt_calls_alone`` gets one request per call and its LM head on that
        request's last position only; every prompt call has at least the backend's ``min_query_rows`` query positions.
        Raises DSparkError when set to a graph of another interface, or to a ``prompt_calls_alone`` backend whose graph
        does not take ``logits_from`` and ``logits_to``."""
        return self._prompt_backend

    @prompt_backend.setter
    def prompt_backend(self, be) -> None:
        if be is not None and (be.spec.kv_layout != "scatter" or be.spec.dims != self.backend.spec.dims):
            raise DSparkError(f"the prompt graph {be.path.name} does not share the target's scatter interface "
                              f"({be.spec.kv_layout}, {be.spec.dims}); rebuild it from this engine's target")
        if be is not None and be.prompt_calls_alone and not (be.takes_logits_from and be.takes_logits_to):
            raise DSparkError(f"prompt chunks on {be.providers[0]} need a target graph that computes the logits of "
                              f"one position (inputs logits_from and logits_to); {be.path.name} was exported before "
                              "them: rebuild the engine (`dspark-export build`)")
        self._prompt_backend = be

    @property
    def prompts_apart(self) -> bool:
        """Whether prompt positions are computed by another graph than the positions decoded after them (their
        cached entries then differ from what decoding the same tokens would cache)."""
        return self._prompt_backend is not None

    def _alloc(self, rows: int, slots: int) -> list:
        kv, d = self._shape
        return [(np.zeros((rows, kv, slots, d), np.float32), np.zeros((rows, kv, slots, d), np.float32))
                for _ in range(self._layers)]

    def _resize(self, rows: int, slots: int) -> None:
        old = self._kv
        r0, s0 = old[0][0].shape[0], old[0][0].shape[2]
        if rows <= r0 and slots <= s0:
            return
        rows, slots = max(rows, r0), max(slots, s0)
        new = self._alloc(rows, slots)
        for (ok, ov), (nk, nv) in zip(old, new):
            nk[:r0, :, :s0] = ok
            nv[:r0, :, :s0] = ov
        self._kv = new

    # -- requests
    def add(self, rid) -> None:
        """Register request ``rid`` (length 0) in a free row. Raises DSparkError if it is already here."""
        if rid in self._row:
            raise DSparkError(f"request {rid!r} is already in the slot cache")
        used = set(self._row.values())
        row = next(i for i in range(len(used) + 1) if i not in used)
        rows = self._kv[0][0].shape[0]
        if row >= rows:
            self._resize(max(1, 2 * rows), self._kv[0][0].shape[2])
        self._row[rid] = row
        self._length[rid] = 0

    def remove(self, rid) -> None:
        """Forget request ``rid`` (its row is reused by the next ``add``); no-op for an unknown id."""
        self._row.pop(rid, None)
        self._length.pop(rid, None)
        self._feats.pop(rid, None)

    def rollback(self, rid, length: int) -> None:
        """Keep the first ``length`` positions of ``rid`` (O(1)). Raises ValueError outside 0..length(rid)."""
        self._check_rollback(rid, length)
        self._length[rid] = length

    def pass_rows(self, lengths: list) -> int:
        """Query rows one ``step`` over segments of these token counts computes: one batch row per segment, each
        padded to the longest, then padded to a multiple of ``row_multiple`` rows (:func:`padded_shape`)."""
        if not lengths:
            return 0
        b, qq = padded_shape(len(lengths), max(lengths), self.row_multiple)
        return b * qq

    can_import_kv = True

    def export_kv(self, rid, start: int, end: int) -> tuple:
        """Copies of request ``rid``'s cached positions start..end-1 (the prefix cache's block payload): per layer
        (key, value) float32 [kv_heads, end - start, head_dim], and its target features float32 [end - start, F]
        or None. Raises ValueError outside 0 <= start < end <= length(rid)."""
        if not 0 <= start < end <= self._length[rid]:
            raise ValueError(f"request {rid!r} holds {self._length[rid]} positions; cannot export {start}..{end}")
        row = self._row[rid]
        kv = [(k[row, :, start:end].copy(), v[row, :, start:end].copy()) for k, v in self._kv]
        f = self._feats.get(rid)
        return kv, None if f is None else f[start:end].copy()

    def import_kv(self, rid, kv: list, features: np.ndarray | None) -> None:
        """Fill an empty request's first n positions from cached arrays (a prefix cache hit): ``kv`` per layer
        (key, value) float32 [kv_heads, n, head_dim], ``features`` float32 [n, F] or None. Raises DSparkError when
        ``rid`` already holds positions or the arrays do not fit this graph."""
        if self._length[rid]:
            raise DSparkError(f"request {rid!r} already holds {self._length[rid]} positions; import a prefix into an "
                              "empty request")
        n = kv[0][0].shape[1]
        if len(kv) != self._layers or kv[0][0].shape != (self._shape[0], n, self._shape[1]):
            raise DSparkError(f"cached prefix of {len(kv)} layers x {kv[0][0].shape} does not fit this graph "
                              f"({self._layers} layers x [{self._shape[0]}, n, {self._shape[1]}])")
        if n > self.slots:
            self._resize(self._kv[0][0].shape[0], -(-n // SLOT_STEP) * SLOT_STEP)
        row = self._row[rid]
        for (k, v), (ck, cv) in zip(self._kv, kv):
            k[row, :, :n] = ck
            v[row, :, :n] = cv
        if features is not None:
            self._store_features(rid, 0, features)
        self._length[rid] = n

    @property
    def slots(self) -> int:
        """Slots per row of the buffers."""
        return int(self._kv[0][0].shape[2])

    def attended_positions(self, rids) -> int:
        """Positions a call reads per row: every slot of the buffers (a multiple of :data:`SLOT_STEP`, never
        shrinking: the longest request so far sets it), at least the longest request's cached length."""
        return max(self.slots, super().attended_positions(rids))

    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return int(sum(k.nbytes + v.nbytes for k, v in self._kv))

    step_hints = True  # step() takes last_only (and argmax_for, ignored: the logits come back) from the loop
    takes_prompt_graph = True

    # -- the graph call
    def step(self, segments: list, argmax_for=(), last_only=()) -> list:
        """Feed every ``(rid, tokens)`` of ``segments`` after that request's cached positions, in one call.

        Returns float32 [q_r, vocab] logits per segment, in order; when every segment's request is in ``last_only``
        (prompt chunks) and the graph takes ``logits_from``, [1, vocab]: its last position's only, and the LM head
        runs on the positions from the shortest segment's last one on (with :attr:`head_skips_padding`, up to the
        longest segment's last one). ``argmax_for`` is accepted for the loop's
        interface and ignored. Raises DSparkError for an unknown or repeated request, an empty segment, or a request
        growing past ``max_slots``.
        """
        if not segments:
            return []
        self._check_segments(segments)
        backend = self.backend
        if self.prompt_backend is not None and last_only:
            prompt = [i for i, (rid, _) in enumerate(segments) if rid in last_only]
            if prompt and len(prompt) < len(segments):  # a mixed call: prompt chunks and the rest apart
                rest = [i for i, (rid, _) in enumerate(segments) if rid not in last_only]
                back = [None] * len(segments)
                for idx, out in ((prompt, self.step([segments[i] for i in prompt], last_only=last_only)),
                                 (rest, self.step([segments[i] for i in rest]))):
                    for i, o in zip(idx, out):
                        back[i] = o
                return back
            if prompt:
                backend = self.prompt_backend
                if backend.prompt_calls_alone and len(segments) > 1:
                    return [self.step([seg], last_only=last_only)[0] for seg in segments]
        order = sorted(range(len(segments)), key=lambda i: self._row[segments[i][0]])
        segs = [segments[i] for i in order]
        b = len(segs)
        bp, qq = padded_shape(b, max(backend.min_query_rows, *(len(t) for _, t in segs)), self.row_multiple)
        need = max(self._length[rid] + qq for rid, _ in segs)
        if self.max_slots is not None and max(self._length[rid] + len(t) for rid, t in segs) > self.max_slots:
            raise DSparkError(f"a request would hold more than {self.max_slots} positions (the context limit)")
        cap = self._kv[0][0].shape[0]
        if need > self.slots or bp > cap:
            self._resize(max(cap, bp), max(self.slots, -(-need // SLOT_STEP) * SLOT_STEP))
            cap = self._kv[0][0].shape[0]
        rows = np.array([self._row[rid] for rid, _ in segs])
        lo = min(int(rows[0]), cap - bp)
        # a contiguous range of rows: views, no copy — unless a dummy row beside them holds a request outside the
        # call (a graph that writes its slots in place would write the dummy row's entries into that request's row)
        held = (set(self._row.values()) - {int(r) for r in rows}) if bp > b and backend.writes_kv_in_place else ()
        if rows[-1] - rows[0] == b - 1 and not any(lo <= r < lo + bp for r in held):
            at = rows - lo  # each request's index in the call
            kv = [(k[lo:lo + bp], v[lo:lo + bp]) for k, v in self._kv]
            views = True
        else:  # a gathered copy; dummy rows repeat the last request's row
            views = False
            at = np.arange(b)
            idx = np.concatenate([rows, np.full(bp - b, rows[-1])])
            kv = [(k[idx], v[idx]) for k, v in self._kv]
        ids = np.zeros((bp, qq), np.int64)  # dummy rows: token 0 at positions 0..qq-1, results dropped
        pos = np.tile(np.arange(qq, dtype=np.int64), (bp, 1))
        for r, (rid, toks) in zip(at, segs):
            t = list(toks)
            ids[r] = t + [t[-1]] * (qq - len(t))
            pos[r] = np.arange(self._length[rid], self._length[rid] + qq)
        slot = np.arange(self.slots)
        mask = slot[None, None, None, :] <= pos[:, None, :, None]  # causal within the row; other rows never seen
        head = {}  # the query positions the LM head runs on, where not all
        if last_only and backend.takes_logits_from and all(r in last_only for r, _ in segs):
            head["logits_from"] = min(len(t) for _, t in segs) - 1
        longest = max(len(t) for _, t in segs)
        if (self._head_skips_padding or backend.prompt_calls_alone) and longest < qq:
            head["logits_to"] = longest
        start = head.get("logits_from", 0)
        out = backend.step(ids, pos, mask, kv, **head)
        results = [None] * b
        written = views and out.kv_written  # the graph wrote the new entries into this runner's buffers itself
        for j, (r, (rid, toks)) in enumerate(zip(at, segs)):
            q, n0, row = len(toks), self._length[rid], rows[j]
            if not written:
                for (k, v), (nk, nv) in zip(self._kv, out.kv):
                    k[row, :, n0:n0 + q] = nk[r, :, :q]
                    v[row, :, n0:n0 + q] = nv[r, :, :q]
            if out.features is not None:
                self._store_features(rid, n0, out.features[r, :q])
            self._length[rid] = n0 + q
            results[j] = out.logits[r, q - 1 - start:q - start] if start else out.logits[r, :q]
        back = [None] * b
        for j, i in enumerate(order):
            back[i] = results[j]
        return back


class _ScatterCacheView:
    """What :class:`~dspark_runtime.runners.kvcache.KVCache` offers to readers of a runner's cache: ``length`` and
    ``view()`` — per layer (key, value) [1, kv_heads, length, head_dim] of one request's slots (views)."""

    def __init__(self, runner: ScatterRunner, rid):
        self._runner, self._rid = runner, rid

    @property
    def length(self) -> int:
        return self._runner.length(self._rid)

    def view(self) -> list:
        r, n = self._runner._row[self._rid], self.length
        return [(k[r:r + 1, :, :n], v[r:r + 1, :, :n]) for k, v in self._runner._kv]


class ScatterSequence(SequenceDecoder):
    """One sequence's view of a scatter-layout graph (a :class:`~dspark_runtime.runners.base.SequenceDecoder`, plus
    ``cache`` and a settable ``row_multiple``): a :class:`ScatterRunner` holding one request, so a request decoded alone
    runs exactly the calls it would run as one row of a batch.
    """

    _RID = 0
    can_import_kv = True

    def __init__(self, backend, row_multiple: int = 1):
        self.backend = backend
        self.slots = ScatterRunner(backend, row_multiple=row_multiple)
        self.slots.add(self._RID)
        self.cache = _ScatterCacheView(self.slots, self._RID)

    @property
    def row_multiple(self) -> int:
        return self.slots.row_multiple

    @row_multiple.setter
    def row_multiple(self, m: int) -> None:
        if int(m) < 1:
            raise DSparkError(f"row_multiple must be a positive integer (1 = no padding), got {m!r}")
        self.slots.row_multiple = int(m)

    @property
    def can_skip_padding_head(self) -> bool:
        return self.slots.can_skip_padding_head

    @property
    def head_skips_padding(self) -> bool:
        """:attr:`ScatterRunner.head_skips_padding` of this sequence (settable)."""
        return self.slots.head_skips_padding

    @head_skips_padding.setter
    def head_skips_padding(self, on: bool) -> None:
        self.slots.head_skips_padding = on

    @property
    def prompt_backend(self):
        """:attr:`ScatterRunner.prompt_backend` of this sequence (settable)."""
        return self.slots.prompt_backend

    @prompt_backend.setter
    def prompt_backend(self, be) -> None:
        self.slots.prompt_backend = be

    @property
    def prompts_apart(self) -> bool:
        return self.slots.prompts_apart

    @property
    def features(self) -> np.ndarray | None:
        return self.slots.features(self._RID)

    @property
    def length(self) -> int:
        return self.slots.length(self._RID)

    def attended_positions(self) -> int:
        """Positions a call reads: the buffers' slots (:meth:`ScatterRunner.attended_positions`)."""
        return self.slots.attended_positions([self._RID])

    def reset(self) -> None:
        self.slots.rollback(self._RID, 0)

    step_hints = True  # step() takes last_only
    takes_prompt_graph = True

    def step(self, tokens, last_only: bool = False) -> np.ndarray:
        """Feed ``tokens`` (q >= 1) after the cached ones; returns logits float32 [q, vocab] ([1, vocab], the last
        position's, with ``last_only`` on a graph that takes ``logits_from``)."""
        return self.slots.step([(self._RID, list(tokens))], last_only={self._RID} if last_only else ())[0]

    def prefill(self, tokens, chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """Feed a prompt in chunks of ``chunk`` tokens; returns the last position's logits [vocab]."""
        return self.slots.prefill(self._RID, list(tokens), chunk)

    def rollback(self, length: int) -> None:
        self.slots.rollback(self._RID, length)

    def export_kv(self, start: int, end: int) -> tuple:
        """:meth:`ScatterRunner.export_kv` of this sequence."""
        return self.slots.export_kv(self._RID, start, end)

    def import_kv(self, kv: list, features: np.ndarray | None) -> None:
        """:meth:`ScatterRunner.import_kv` into this (emptied) sequence."""
        self.slots.import_kv(self._RID, kv, features)
