"""How an engine picks and builds its drafter: which drafters a manifest holds, what ``draft="auto"`` means, and the
:class:`EngineDrafters` part of :class:`dspark_runtime.engine.Engine` that resolves a ``draft`` choice to a drafter
(:mod:`dspark_runtime.drafting.drafters`, :mod:`dspark_runtime.drafting.dspark`, :mod:`dspark_runtime.drafting.router`)."""
from __future__ import annotations

from dspark_runtime.drafting.drafters import LMDrafter, NgramDrafter
from dspark_runtime.drafting.dspark import THRESHOLD_RULES, DSparkDrafter, DSparkHeads
from dspark_runtime.errors import InputError
from dspark_runtime.engine_dir.manifest import Manifest
from dspark_runtime.drafting.router import Router, router_priors


def manifest_drafters(manifest: Manifest) -> tuple:
    """(the draft LM's graph key or None, the DSpark drafter's graph key or None) of an engine manifest: the
    ``causal_lm`` graph named by ``speculation.draft_graph`` and the ``dspark_draft`` graph, where present."""
    dg = manifest.speculation.draft_graph
    lm = dg if dg in manifest.graphs and manifest.graphs[dg].spec.kind == "causal_lm" else None
    ds = next((k for k, g in manifest.graphs.items() if g.spec.kind == "dspark_draft"), None)
    return lm, ds


def auto_draft_choice(lm_graph: str | None, dspark_graph: str | None, schedulable: bool = False) -> str:
    """What ``draft="auto"`` runs given the engine's drafters: the router over the DSpark drafter when it can
    schedule (``schedulable``: :func:`manifest_schedulable`; it then runs with scheduled verify lengths), else the
    draft LM when there is one, else the router over an uncalibrated DSpark drafter (fixed blocks), else n-gram
    lookup. Measured in :meth:`Engine.auto_draft`."""
    if dspark_graph and schedulable:
        return "router"
    return "lm" if lm_graph else ("router" if dspark_graph else "ngram")


def manifest_schedulable(manifest: Manifest) -> bool:
    """Whether the engine's DSpark drafter can run with scheduled verify lengths: its confidence head calibrated
    (``speculation.dspark.sts_temperatures``) and a profiled cost table (``speculation.cost_table``)."""
    sp = manifest.speculation
    return bool(sp.dspark is not None and sp.dspark.sts_temperatures and sp.cost_table)


class EngineDrafters:
    """The drafter choice of :class:`~dspark_runtime.engine.Engine` (its base class). It reads the engine's
    ``dir``, ``manifest``, ``_backends`` (graph key -> backend), ``lm_graph`` / ``dspark_graph`` / ``draft_graph`` /
    ``draft_kind`` (:func:`manifest_drafters`), ``_heads``, ``prefix_cache`` and ``loop_runner``."""

    @property
    def has_draft(self) -> bool:
        return bool(self.draft_graph) and self.draft_graph in self._backends

    def auto_draft(self) -> str:
        """What ``draft="auto"`` means for this engine (:func:`auto_draft_choice`): the router over its calibrated
        DSpark drafter with scheduled verify lengths (with a profiled cost table), else its draft LM, else the
        router over an uncalibrated DSpark drafter, else n-gram lookup. Measured on the 1.5B int4 target, 2-core
        CPU, the same runs beside the 0.5B int4 draft LM at gamma 3 (docs/serving.md, docs/drafter.md): one
        request, 32 prompts, 128 tokens: the router 1.47x int4 target-only, the LM 1.43x; served to 1, 2, 4, 8
        concurrent clients the router led the LM at every level (scripts/serve_bench.py)."""
        have = self._backends
        return auto_draft_choice(self.lm_graph if self.lm_graph in have else None,
                                 self.dspark_graph if self.dspark_graph in have else None,
                                 manifest_schedulable(self.manifest))

    def resolve_draft(self, draft) -> str | None:
        """The drafter a ``draft`` choice names on this engine: "auto" -> :meth:`auto_draft`, "draft" -> the engine's
        own kind; None/"none" -> None. Raises InputError for an unknown name or a drafter the engine lacks."""
        if draft in (None, "none"):
            return None
        if draft == "auto":
            draft = self.auto_draft()
        if draft == "draft":
            draft = self.draft_kind or "lm"
        if draft not in ("router", "dspark", "lm", "ngram"):
            raise InputError(f"unknown draft {draft!r}: use 'auto', 'router', 'dspark', 'lm', 'ngram' or 'none'")
        if draft == "router" and not self.has_draft:
            raise InputError("draft='router' needs a DSpark drafter or a draft LM in the engine; use "
                             "draft='ngram' or rebuild with a draft")
        if draft == "dspark" and self.dspark_graph is None:
            raise InputError("this engine has no DSpark drafter; build one with `dspark-export build "
                             "--draft dspark:<checkpoint>` (or `dspark-export add-draft`), or use "
                             "draft='lm'/'ngram'")
        if draft == "lm" and self.lm_graph is None:
            raise InputError("this engine has no draft graph; use draft='ngram', rebuild with a draft, "
                             "or decode target-only (--no-speculation)")
        return draft

    def graphs_used(self, draft) -> list:
        """The graph keys a ``draft`` choice runs: "target", plus the draft LM's or the DSpark drafter's graph (the
        router's: the engine's model drafter). Raises InputError as :meth:`resolve_draft`."""
        kind = self.resolve_draft(draft)
        kind = self.draft_kind if kind == "router" else kind
        extra = {"lm": self.lm_graph, "dspark": self.dspark_graph}.get(kind)
        return ["target"] + ([extra] if extra else [])

    def drafter(self, draft, target, confidence_threshold=None, confidence_rule: str = "survival",
                max_batch: int = 8):
        """The drafter (:mod:`dspark_runtime.drafting.drafters` interface) for a ``draft`` choice (see :meth:`generate`)
        over the verifier runner ``target`` (the DSpark drafter reads its features); None for target-only.
        ``confidence_rule`` (:data:`dspark_runtime.drafting.dspark.THRESHOLD_RULES`) is how the DSpark drafter applies
        ``confidence_threshold``; a rule other than "survival" with a drafter that is not DSpark raises InputError,
        as do the errors of :meth:`resolve_draft` and a malformed router entry in the manifest."""
        if confidence_rule not in THRESHOLD_RULES:
            raise InputError(f"unknown draft_confidence_rule {confidence_rule!r}; choose one of {list(THRESHOLD_RULES)}")
        draft = self.resolve_draft(draft)
        if draft is None:
            return None
        if draft == "router":  # issue 9: per round, n-gram lookup or the engine's model drafter
            try:  # n-gram and model-drafter acceptance fitted on the calibration split (dspark-export calibrate)
                priors = router_priors(self.manifest.speculation.router, self.draft_kind)
            except ValueError as e:
                raise InputError(f"{self.dir}/manifest.json: speculation.router is malformed ({e}); re-run "
                                 "`dspark-export calibrate` on this engine") from None
            return Router(self.drafter(self.draft_kind, target, confidence_threshold, confidence_rule, max_batch),
                          **priors)
        if draft == "dspark":
            return DSparkDrafter(self._backends[self.dspark_graph].activate(), self.dspark_heads(), target,
                                 confidence_threshold, threshold_rule=confidence_rule)
        if confidence_rule != "survival":
            raise InputError(f"draft_confidence_rule={confidence_rule!r} applies to the DSpark drafter only (draft "
                             f"{draft!r} ends a block after its first draft token below draft_confidence); use "
                             "draft='dspark' or 'router' over a DSpark drafter, or drop the rule")
        if draft == "lm":
            runner = self.loop_runner(self.lm_graph, max_batch)
            return LMDrafter(runner, confidence_threshold, self.prefix_cache if runner.can_import_kv else None)
        return NgramDrafter()

    def dspark_heads(self) -> DSparkHeads:
        """The DSpark Markov/confidence heads of this engine (loaded once), with the manifest's STS temperatures."""
        if self._heads is None:
            info = self.manifest.speculation.dspark
            if info is None:
                from dspark_runtime.errors import ManifestError

                raise ManifestError(f"{self.dir}/manifest.json has a DSpark drafter graph ({self.dspark_graph!r}) but "
                                    "no speculation.dspark section; rebuild it with `dspark-export add-draft`")
            vocab = self.manifest.graphs["target"].spec.dims.vocab_size
            self._heads = DSparkHeads.load(self.dir / info.heads_file, info, vocab, info.sts_temperatures)
        return self._heads
