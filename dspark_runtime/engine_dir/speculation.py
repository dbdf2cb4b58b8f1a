"""The ``speculation`` section of an engine manifest, typed: :class:`Speculation` (draft graph and kind, default draft
length, the DSpark and EAGLE-3 drafters, router priors, cost table, row padding), :class:`DSparkSection` and
:class:`Eagle3Section`, and what they imply without loading a graph: the engine's drafters (:func:`manifest_drafters`,
:func:`manifest_eagle3`), whether it can schedule verify lengths (:func:`manifest_schedulable`), what ``draft="auto"``
picks (:func:`auto_draft_choice`) and the summary ``dspark info`` prints (:func:`speculation_summary`). Written by
``build``, ``add-draft``, ``profile``, ``calibrate`` and ``quantize``; read by the runtime. Pure data, no engine I/O;
see :mod:`dspark_runtime.engine_dir.manifest` for the whole schema.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dspark_runtime.errors import ManifestError
from dspark_runtime.scheduling.cost_table import check_cost_table


def _fail(where: str | None, key: str, what: str, value) -> ManifestError:
    """The ManifestError for entry ``key`` ("speculation.draft_length") of the wrong type or value: names the
    key, what it must be and the fix."""
    return ManifestError(f"{where + ': ' if where else ''}{key} must be {what}, got {value!r}; "
                         "rebuild the engine or fix manifest.json")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


DRAFT_KINDS = ("dspark", "lm")  # speculation.draft_kind
EMBEDDING_DTYPES = ("float32", "float16", "blocks")  # speculation.dspark.embedding.dtype


def _block_layout(b) -> bool:
    """Whether ``b`` is the ``blocks`` object of a block-coded embedding entry
    (:class:`dspark_runtime.drafting.embedding_rows.EmbeddingRows`)."""
    return (isinstance(b, dict) and b.get("bits") in (4, 8) and _is_int(b.get("size")) and b["size"] > 0
            and _is_int(b.get("zero_point")) and _is_int(b.get("scales_offset")) and b["scales_offset"] >= 0
            and (b.get("offsets_offset") is None or _is_int(b["offsets_offset"]) and b["offsets_offset"] >= 0))

# (what the value must be, its check) per kind of typed entry; None is checked before (optional entries)
_CHECKS = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "nonempty_str": ("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "nonneg_int": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "positive_int": ("a positive integer", lambda v: _is_int(v) and v > 0),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "dict": ("an object", lambda v: isinstance(v, dict)),
    "int_list": ("a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v))),
    "positive_list": ("a list of positive numbers",
                      lambda v: isinstance(v, list) and all(_is_number(x) and x > 0 for x in v)),
    "draft_kind": ("'dspark' or 'lm'", lambda v: v in DRAFT_KINDS),
    "embedding": ("an object {\"file\": str, \"offset\": int >= 0, \"dtype\": \"float32\" | \"float16\" | "
                  "\"blocks\", \"shape\": [vocab, hidden]} (\"blocks\" with \"blocks\": {\"bits\": 4 | 8, \"size\": int, "
                  "\"zero_point\": int, \"scales_offset\": int, \"offsets_offset\": int | null})",
                  lambda v: isinstance(v, dict) and isinstance(v.get("file"), str) and bool(v.get("file"))
                  and _is_int(v.get("offset")) and v["offset"] >= 0 and v.get("dtype") in EMBEDDING_DTYPES
                  and isinstance(v.get("shape"), list) and len(v["shape"]) == 2
                  and all(_is_int(x) and x > 0 for x in v["shape"])
                  and (v["dtype"] != "blocks" or _block_layout(v.get("blocks")))),
}


def _read_section(cls, d, section: str, where: str | None):
    """An instance of the section dataclass ``cls`` (its ``_TYPES``: key -> kind of ``_CHECKS``, in the order
    written; ``_REQUIRED``: keys that must be present and not null) from the JSON object ``d``: typed keys checked,
    other keys kept in ``extra``; the key order and the keys that were null are remembered so ``to_json`` writes
    the object back unchanged. Raises ManifestError naming ``<section>.<key>`` (and ``where``) and the fix."""
    if not isinstance(d, dict):
        raise _fail(where, section, "an object", d)
    for key in cls._REQUIRED:
        if d.get(key) is None:
            raise ManifestError(f"{where + ': ' if where else ''}{section}.{key} is missing (the {section} section "
                                f"needs {', '.join(cls._REQUIRED)}); rebuild the engine or fix manifest.json")
    kw, extra = {}, {}
    for key, v in d.items():
        kind = cls._TYPES.get(key)
        if kind is None:
            extra[key] = v
        elif v is not None:
            if kind in _CHECKS:
                what, ok = _CHECKS[kind]
                if not ok(v):
                    raise _fail(where, f"{section}.{key}", what, v)
            kw[key] = v
    out = cls(**kw, extra=extra)
    out._order = tuple(d)
    out._nulls = frozenset(k for k, v in d.items() if v is None and k in cls._TYPES)
    return out


def _write_section(s, values: dict) -> dict:
    """``values`` (typed key -> value, in the canonical order) of section ``s`` as written: None values omitted
    unless the key was null when read, ``extra`` after them; keys that were read come in the order they were
    read, new ones after."""
    out = {k: v for k, v in values.items() if v is not None or k in s._nulls}
    out.update((k, v) for k, v in s.extra.items() if k not in values)
    if s._order:
        rank = {k: i for i, k in enumerate(s._order)}
        out = dict(sorted(out.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    return out


@dataclass
class DSparkSection:
    """``speculation.dspark`` of the manifest: the engine's DSpark drafter (written by ``dspark-export build
    --draft dspark:<checkpoint>`` and ``add-draft``; ``calibrate`` sets ``sts_temperatures`` and ``calibration``).

    graph (str):            key of the drafter's ``dspark_draft`` graph in ``Manifest.graphs`` ("draft", "dspark").
    heads_file (str):       the Markov/confidence heads file (numpy ``.npz``), relative to the engine directory.
    block_size (int > 0):   tokens per DSpark block (the drafter's γ).
    mask_token_id (int):    the mask token the drafter was trained with.
    target_layer_ids (list[int]): target layers whose features the drafter reads.
    markov_rank (int | None), markov_head_type (str | None: "vanilla", "gated", "rnn"), confidence_head
    (bool | None), confidence_head_with_markov (bool | None): the heads' shape, as
    :meth:`dspark_runtime.drafting.dspark.DSparkHeads.load` reads them (no Markov head when ``markov_rank`` is 0 or None).
    draft_vocab_size (int | None): the reduced draft vocabulary's size; None = the target's.
    sts_temperatures (list[float] | None): per-position STS temperatures (None: uncalibrated).
    calibration (dict | None): what ``calibrate`` fitted them on ({"rounds", "ece": [...]}).
    embedding (dict | None): where the anchor's embedding rows are read (the drafter graph holds no [V, d] table):
                            {"file": path relative to the engine directory, "offset": bytes, "dtype": "float32" |
                            "float16", "shape": [vocab, hidden]}, a raw row-major array — the target graph's own
                            table in its external data where it has one (``add-draft``); None for drafter graphs
                            that embed the anchor id themselves (engines built by earlier versions).
    extra (dict):           any other key of the section, kept and written back unchanged.

    Build one with :meth:`from_json` (validates) or directly (not validated); :meth:`to_json` writes it.
    """

    graph: str
    heads_file: str
    block_size: int
    mask_token_id: int
    target_layer_ids: list
    markov_rank: int | None = None
    markov_head_type: str | None = None
    confidence_head: bool | None = None
    confidence_head_with_markov: bool | None = None
    draft_vocab_size: int | None = None
    sts_temperatures: list | None = None
    calibration: dict | None = None
    embedding: dict | None = None
    extra: dict = field(default_factory=dict)
    _order: tuple = field(default=(), init=False, repr=False, compare=False)
    _nulls: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    # key -> kind of check (_CHECKS), in the order build writes them
    _TYPES = {"graph": "nonempty_str", "heads_file": "nonempty_str", "markov_rank": "nonneg_int",
              "markov_head_type": "str", "confidence_head": "bool", "confidence_head_with_markov": "bool",
              "block_size": "positive_int", "mask_token_id": "nonneg_int", "target_layer_ids": "int_list",
              "draft_vocab_size": "positive_int", "sts_temperatures": "positive_list", "calibration": "dict",
              "embedding": "embedding"}
    _REQUIRED = ("graph", "heads_file", "block_size", "mask_token_id", "target_layer_ids")

    @classmethod
    def from_json(cls, d: dict, where: str | None = None) -> "DSparkSection":
        """The section from its JSON object ``d``. Raises ManifestError (naming ``where``, the key and the fix)
        when a required key is missing or null, or a typed key has the wrong type or value."""
        return _read_section(cls, d, "speculation.dspark", where)

    def to_json(self) -> dict:
        """The JSON object: the keys that are set (None omitted, unless the key was null when read) and ``extra``,
        in the order read."""
        return _write_section(self, {k: getattr(self, k) for k in self._TYPES})


@dataclass
class Eagle3Section:
    """``speculation.eagle3`` of the manifest: the engine's EAGLE-3 drafter (written by ``dspark-export add-draft``
    with a DeepSpec or SpecForge EAGLE-3 checkpoint).

    graph (str):            key of the drafter's ``eagle3_draft`` graph in ``Manifest.graphs`` ("eagle3").
    target_layer_ids (list[int]): target layers whose features the drafter fuses, in its order (a subset of the
                            target graph's feature layers).
    ttt_length (int > 0):   the draft tokens per round it was trained for (the default γ of ``draft="eagle3"``).
    embedding (dict):       where the tokens' embedding rows are read, as ``speculation.dspark.embedding``.
    draft_vocab_file (str | None): a reduced draft vocabulary (SpecForge's d2t/t2d): a numpy ``.npy`` file, relative
                            to the engine directory, of int64 [V_d] target ids, one per column of the graph's logits;
                            None = the logits cover the target's vocabulary.
    extra (dict):           any other key of the section, kept and written back unchanged.
    """

    graph: str
    target_layer_ids: list
    ttt_length: int
    embedding: dict
    draft_vocab_file: str | None = None
    extra: dict = field(default_factory=dict)
    _order: tuple = field(default=(), init=False, repr=False, compare=False)
    _nulls: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    _TYPES = {"graph": "nonempty_str", "target_layer_ids": "int_list", "ttt_length": "positive_int",
              "embedding": "embedding", "draft_vocab_file": "nonempty_str"}
    _REQUIRED = ("graph", "target_layer_ids", "ttt_length", "embedding")

    @classmethod
    def from_json(cls, d: dict, where: str | None = None) -> "Eagle3Section":
        """The section from its JSON object ``d``; raises ManifestError as :meth:`DSparkSection.from_json`."""
        return _read_section(cls, d, "speculation.eagle3", where)

    def to_json(self) -> dict:
        return _write_section(self, {k: getattr(self, k) for k in self._TYPES})


@dataclass
class Speculation:
    """``speculation`` of the manifest: how the engine drafts. Written by ``dspark-export build`` (draft_graph,
    draft_kind, draft_length, dspark, router), ``add-draft`` (dspark, router), ``calibrate`` (dspark's STS
    temperatures and calibration, router), ``profile`` (cost_table, row_invariance), ``quantize`` (drops
    cost_table and row_invariance: they were measured on the source engine's graphs).

    draft_graph (str | None):  key of the draft LM's graph (``causal_lm``) or of the only drafter's graph.
    draft_kind (str | None):   "dspark" or "lm": the kind of ``draft_graph`` (absent in engines whose draft
                               graph is a draft LM built before it was recorded).
    draft_length (int > 0 | None): the default draft tokens per round (--draft-length).
    dspark (DSparkSection | None): the DSpark drafter, where the engine has one.
    eagle3 (Eagle3Section | None): the EAGLE-3 drafter, where the engine has one.
    router (dict | None):      the router's calibrated priors; its inner format belongs to
                               :func:`dspark_runtime.drafting.router.router_priors`, which checks it.
    cost_table (dict | None):  the measured round costs (:func:`dspark_runtime.machine.cost_profile.profile_runtime`), with
                               context buckets where profiled (:mod:`dspark_runtime.scheduling.cost_table` checks them).
    row_invariance (dict | None): the target's row padding probe (:mod:`dspark_runtime.machine.row_invariance`).
    extra (dict):              any other key, kept and written back unchanged (manifests of newer tools).

    Build one with :meth:`from_json` (validates) or directly (not validated); :meth:`to_json` writes it.
    """

    draft_graph: str | None = None
    draft_kind: str | None = None
    draft_length: int | None = None
    dspark: DSparkSection | None = None
    eagle3: Eagle3Section | None = None
    router: dict | None = None
    cost_table: dict | None = None
    row_invariance: dict | None = None
    extra: dict = field(default_factory=dict)
    _order: tuple = field(default=(), init=False, repr=False, compare=False)
    _nulls: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    # key -> kind of check (_CHECKS; "section": DSparkSection / Eagle3Section.from_json), in the order build writes
    _TYPES = {"draft_graph": "nonempty_str", "draft_kind": "draft_kind", "draft_length": "positive_int",
              "dspark": "section", "eagle3": "section", "router": "dict", "cost_table": "dict",
              "row_invariance": "dict"}
    _REQUIRED = ()

    @classmethod
    def from_json(cls, d: dict | None, where: str | None = None) -> "Speculation":
        """The section from its JSON object ``d`` (None: an empty one). Raises ManifestError (naming ``where``,
        the key and the fix) when ``d`` is not an object or an entry has the wrong type or value, e.g.
        "speculation.draft_length must be a positive integer, got 'x'; rebuild the engine or fix manifest.json"."""
        if d is None:
            return cls()
        s = _read_section(cls, d, "speculation", where)
        if s.dspark is not None:
            s.dspark = DSparkSection.from_json(s.dspark, where)
        if s.eagle3 is not None:
            s.eagle3 = Eagle3Section.from_json(s.eagle3, where)
        if s.cost_table is not None:  # its context buckets (dspark_runtime.scheduling.cost_table); older tables pass as they are
            try:
                check_cost_table(s.cost_table)
            except ValueError as e:
                raise ManifestError(f"{where + ': ' if where else ''}speculation.{e}") from None
        return s

    def to_json(self) -> dict:
        """The JSON object: the keys that are set (None omitted, unless the key was null when read) and ``extra``,
        in the order read; an existing manifest's section round-trips unchanged."""
        values = {k: getattr(self, k) for k in self._TYPES}
        if self.dspark is not None:
            values["dspark"] = self.dspark.to_json()
        if self.eagle3 is not None:
            values["eagle3"] = self.eagle3.to_json()
        return _write_section(self, values)


def manifest_drafters(manifest) -> tuple:
    """(the draft LM's graph key or None, the DSpark drafter's graph key or None) of an engine
    :class:`~dspark_runtime.engine_dir.manifest.Manifest`: the ``causal_lm`` graph named by
    ``speculation.draft_graph`` and the ``dspark_draft`` graph, where present."""
    dg = manifest.speculation.draft_graph
    lm = dg if dg in manifest.graphs and manifest.graphs[dg].spec.kind == "causal_lm" else None
    ds = next((k for k, g in manifest.graphs.items() if g.spec.kind == "dspark_draft"), None)
    return lm, ds


def manifest_eagle3(manifest) -> str | None:
    """The graph key of the engine's EAGLE-3 drafter (its ``eagle3_draft`` graph), or None."""
    return next((k for k, g in manifest.graphs.items() if g.spec.kind == "eagle3_draft"), None)


def manifest_schedulable(manifest) -> bool:
    """Whether the engine's DSpark drafter can run with scheduled verify lengths: its confidence head (none in a
    DFlash drafter, ``confidence_head`` false) calibrated (``speculation.dspark.sts_temperatures``) and a profiled
    cost table (``speculation.cost_table``)."""
    sp = manifest.speculation
    return bool(sp.dspark is not None and sp.dspark.confidence_head is not False and sp.dspark.sts_temperatures
                and sp.cost_table)


def auto_draft_choice(lm_graph: str | None, dspark_graph: str | None, schedulable: bool = False) -> str:
    """What ``draft="auto"`` runs given the engine's drafters: the router over the DSpark drafter when it can
    schedule (``schedulable``: :func:`manifest_schedulable`; it then runs with scheduled verify lengths), else the
    draft LM when there is one, else the router over an uncalibrated DSpark drafter (fixed blocks), else n-gram
    lookup. ``dspark_graph``: the router's model drafter (an EAGLE-3 drafter's graph where the engine has no DSpark
    one). Measured in :meth:`dspark_runtime.engine.Engine.auto_draft`."""
    if dspark_graph and schedulable:
        return "router"
    return "lm" if lm_graph else ("router" if dspark_graph else "ngram")


def speculation_summary(m) -> list:
    """``dspark info``'s lines (str, indented) on speculation for manifest ``m``: the engine's drafters, what ``--draft auto``
    runs and with how many draft tokens per round (as ``Engine.auto_draft`` and ``Engine.generate`` decide: the
    router over a calibrated DSpark drafter with scheduled verify lengths when the engine has a cost table, else the
    draft LM at the manifest's draft_length, else the router over the DSpark drafter's block_size-token blocks, else
    n-gram lookup at draft_length), and whether router priors exist."""
    sp = m.speculation
    dl = sp.draft_length
    lm, ds = manifest_drafters(m)
    e3 = manifest_eagle3(m)
    scheduled = manifest_schedulable(m)
    choice = auto_draft_choice(lm, ds or e3, scheduled)
    block = sp.dspark.block_size if sp.dspark is not None else "?"
    drafters = ([f"draft LM '{lm}'"] if lm else []) + ([f"DSpark drafter '{ds}' ({block}-token blocks)"] if ds else [])
    if e3:
        info = sp.eagle3
        drafters.append(f"EAGLE-3 drafter '{e3}' ({info.ttt_length} draft steps per round, target layers "
                        f"{info.target_layer_ids})" if info is not None else f"EAGLE-3 drafter '{e3}'")
    if not ds and e3:  # the router's model drafter is then the EAGLE-3 one
        block = f"{sp.eagle3.ttt_length if sp.eagle3 is not None else '?'}-step EAGLE-3"
        unit = "draft"
    else:
        unit = "DSpark block" + (" or the EAGLE-3 drafter's draft (the model drafter whose learned acceptance promises "
                                 "more)" if ds and e3 else "")
    lines = [f"  drafters: {', '.join(drafters) or 'none (n-gram prompt lookup only)'}"]
    if choice == "lm":
        auto = f"the draft LM '{lm}', default draft length {dl} (draft tokens per round; --draft-length overrides)"
    elif choice == "router" and scheduled:
        auto = (f"the router: per round, n-gram prompt lookup or a {block}-token {unit}, whichever is expected "
                "to commit more, verify lengths scheduled from the calibrated survivals and the cost table "
                "(--draft-length N: fixed blocks of at most N)")
    elif choice == "router":
        needs = ("`dspark-export profile` first: without a confidence head the router schedules from learned "
                 "acceptance" if sp.dspark is not None and sp.dspark.confidence_head is False
                 else "`dspark-export calibrate` and `profile` first")
        auto = (f"the router: per round, n-gram prompt lookup or a {block}-token {unit}, whichever is expected "
                f"to commit more (--draft-length N caps the block; 'scheduled' needs {needs})")
    else:
        auto = f"n-gram prompt lookup, default draft length {dl} (draft tokens per round)"
    lines.append(f"  --draft auto: {auto}")
    if lm or ds or e3:  # --draft router works over any model drafter
        r = sp.router
        if r:
            what = (["n-gram acceptance by match extent"] if r.get("ngram") else []) + [
                f"{k} acceptance by position" for k in (r.get("inner") or {})]
            lines.append(f"  router priors: fitted ({', '.join(what) or 'empty'}; {r.get('sequences', '?')} "
                         f"sequences; {r.get('fitted_on') or 'data not recorded'})")
        else:
            lines.append("  router priors: none (--draft router starts from its built-in priors; `dspark-export "
                         "calibrate` fits them on the calibration split"
                         + (")" if ds else " of an engine with a DSpark drafter)"))
    return lines
