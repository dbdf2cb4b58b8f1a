"""How an engine picks and builds its drafter: :class:`DrafterFactory` resolves a ``draft`` choice over an engine's
graphs and manifest, builds the :class:`~dspark_runtime.drafting.base.Drafter` it names, and says beforehand what
that drafter needs and implies (its block size, whether it reads target features, the default γ, the fitted
acceptance prior of the skip rule: the decoding loop's :class:`~dspark_runtime.decoding.settings.LoopSettings`)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from dspark_runtime.decoding.settings import LoopSettings
from dspark_runtime.drafting.base import Drafter
from dspark_runtime.drafting.drafters import LMDrafter, NgramDrafter
from dspark_runtime.drafting.dspark import THRESHOLD_RULES, DSparkDrafter, DSparkHeads
from dspark_runtime.drafting.eagle3 import Eagle3Drafter, feature_columns
from dspark_runtime.drafting.router import NGRAM_MAX_LENGTH, Router, router_priors
from dspark_runtime.engine_dir.manifest import Manifest
from dspark_runtime.engine_dir.speculation import (auto_draft_choice, manifest_drafters, manifest_eagle3,
                                                   manifest_schedulable)
from dspark_runtime.errors import DSparkError, InputError, ManifestError

KINDS = ("router", "dspark", "eagle3", "lm", "ngram")


class DrafterFactory:
    """The drafters of one engine.

    Args:
        engine_dir, manifest: the engine's directory and manifest.
        backends: {graph key: backend}, the engine's (shared, not copied: the engine may swap a backend in).
        loop_runner: ``(graph key, max requests) -> BatchRunner``, the engine's runner for a draft LM's graph.
    ``lm_graph`` / ``dspark_graph`` / ``eagle3_graph``: the draft LM's / DSpark drafter's / EAGLE-3 drafter's graph
    key or None (:func:`~dspark_runtime.engine_dir.speculation.manifest_drafters`, ``manifest_eagle3``);
    ``draft_graph`` / ``draft_kind``: the model drafter's, the one the router runs (DSpark first, then EAGLE-3, then
    the draft LM).
    """

    def __init__(self, engine_dir: Path, manifest: Manifest, backends: dict, loop_runner: Callable):
        self.dir, self.manifest, self._backends, self._loop_runner = Path(engine_dir), manifest, backends, loop_runner
        self.lm_graph, self.dspark_graph = manifest_drafters(manifest)
        self.eagle3_graph = manifest_eagle3(manifest)
        self.draft_graph = self.dspark_graph or self.eagle3_graph or self.lm_graph
        self.draft_kind = ("dspark" if self.dspark_graph else "eagle3" if self.eagle3_graph
                           else "lm" if self.lm_graph else None)
        self._heads = None

    @property
    def has_draft(self) -> bool:
        return bool(self.draft_graph) and self.draft_graph in self._backends

    def auto_draft(self) -> str:
        """What ``draft="auto"`` means here (:func:`~dspark_runtime.engine_dir.speculation.auto_draft_choice`): the
        router over a calibrated DSpark drafter with scheduled verify lengths (with a profiled cost table), else the
        draft LM, else the router over an uncalibrated DSpark drafter, else n-gram lookup (measured in
        docs/serving.md)."""
        have = self._backends
        model = self.dspark_graph or self.eagle3_graph  # the router's model drafter, where it is not a draft LM
        return auto_draft_choice(self.lm_graph if self.lm_graph in have else None,
                                 model if model in have else None, manifest_schedulable(self.manifest))

    def resolve(self, draft) -> str | None:
        """The drafter kind a ``draft`` choice names: "auto" -> :meth:`auto_draft`, "draft" -> the engine's model
        drafter, None/"none" -> None. Raises InputError for an unknown name or a drafter the engine lacks."""
        if draft in (None, "none"):
            return None
        if draft == "auto":
            draft = self.auto_draft()
        if draft == "draft":
            draft = self.draft_kind or "lm"
        if draft not in KINDS:
            raise InputError(f"unknown draft {draft!r}: use 'auto', 'router', 'dspark', 'eagle3', 'lm', 'ngram' or "
                             "'none'")
        if draft == "router" and not self.has_draft:
            raise InputError("draft='router' needs a DSpark drafter or a draft LM in the engine; use "
                             "draft='ngram' or rebuild with a draft")
        if draft == "dspark" and self.dspark_graph is None:
            raise InputError("this engine has no DSpark drafter; build one with `dspark-export build "
                             "--draft dspark:<checkpoint>` (or `dspark-export add-draft`), or use "
                             "draft='lm'/'ngram'")
        if draft == "eagle3" and self.eagle3_graph is None:
            raise InputError("this engine has no EAGLE-3 drafter; add one with `dspark-export add-draft ENGINE "
                             "<EAGLE-3 checkpoint>`, or use draft='dspark'/'lm'/'ngram'")
        if draft == "lm" and self.lm_graph is None:
            raise InputError("this engine has no draft graph; use draft='ngram', rebuild with a draft, "
                             "or decode target-only (--no-speculation)")
        return draft

    def graphs_used(self, draft) -> list:
        """The graph keys a ``draft`` choice runs: "target", plus the draft LM's or the DSpark drafter's graph (the
        router's: the engine's model drafter). Raises InputError as :meth:`resolve`."""
        kind = self.resolve(draft)
        kind = self.draft_kind if kind == "router" else kind
        extra = {"lm": self.lm_graph, "dspark": self.dspark_graph, "eagle3": self.eagle3_graph}.get(kind)
        return ["target"] + ([extra] if extra else [])

    # -- what a drafter kind implies, before it is built

    def _inner(self, kind: str | None) -> str | None:
        return self.draft_kind if kind == "router" else kind

    def block_size(self, kind: str | None) -> int | None:
        """The most tokens one pass of drafter ``kind`` drafts for a request (the DSpark block, also inside the
        router), or None."""
        return self._backends[self.dspark_graph].block_size if self._inner(kind) == "dspark" else None

    def reads_target_features(self, kind: str | None) -> bool:
        """Whether drafter ``kind`` reads the target runner's features (the DSpark and EAGLE-3 drafters, also inside
        the router)."""
        return self._inner(kind) in ("dspark", "eagle3")

    def default_gamma(self, kind: str | None, draft_length, fallback: int) -> int:
        """A request's draft-length cap for drafter ``kind`` and a ``draft_length`` choice: with scheduled lengths the
        router's longest continuation (its n-gram ones may run past a block), a DSpark block (an EAGLE-3 drafter's
        ``ttt_length``) by default or when scheduled, else ``draft_length`` when it is a number, else ``fallback``."""
        block = self.block_size(kind)
        if self._inner(kind) == "eagle3":
            block = self.manifest.speculation.eagle3.ttt_length
        if kind == "router" and draft_length == "scheduled":
            return max(block or 0, NGRAM_MAX_LENGTH)
        if block and draft_length in (None, "scheduled"):
            return block
        return draft_length if isinstance(draft_length, int) else fallback

    def loop_settings(self, kind: str | None, auto: bool, draft_length, max_batch, prefill_budget, draft_skip,
                      default_draft_length: int) -> LoopSettings:
        """A decoding loop's settings for drafter ``kind`` (``auto``: picked by ``draft="auto"``) and
        :meth:`dspark_runtime.engine.Engine.batch`'s arguments: scheduled verify lengths (with the manifest's cost
        table) where asked for, or where auto picked the router over a DSpark drafter that can schedule; the drafter's
        default γ (``default_draft_length`` where it has none of its own); the skip rule's fitted prior.
        Raises InputError for a bad ``draft_length``, "scheduled" with a drafter that has no confidence head or
        without a cost table, and what :class:`LoopSettings` refuses."""
        if draft_length not in (None, "auto", "scheduled") and (isinstance(draft_length, bool)
                                                                or not isinstance(draft_length, int)
                                                                or draft_length < 1):
            raise InputError(f"draft_length must be a positive integer, 'auto' or 'scheduled', got {draft_length!r}")
        if auto and draft_length is None and kind == "router" and manifest_schedulable(self.manifest):
            draft_length = "scheduled"  # what auto picked the router for (auto_draft_choice)
        scheduled = draft_length == "scheduled"
        if scheduled and kind not in ("dspark", "router"):
            raise InputError("draft_length='scheduled' needs the DSpark drafter (its confidence head) or the "
                             "router; use draft='dspark'/'router' or an integer draft_length")
        if scheduled and kind == "dspark":  # a drafter without the confidence head cannot schedule, profiled or not
            self.check_confidence("draft_length='scheduled' with draft='dspark' (verify lengths from calibrated "
                                  "survivals)", "use an integer draft_length, or draft='router' (it schedules from "
                                  "learned acceptance)")
        table = self.manifest.speculation.cost_table  # the manifest's, or the re-profiled one (profile)
        if scheduled and not table:
            raise InputError("this engine has no cost table for the scheduler; run `dspark-export profile "
                             f"{self.dir}` on this machine first (or `dspark generate --profile-on-load`)")
        gamma = self.default_gamma(kind, draft_length, default_draft_length)
        return LoopSettings(mode="scheduled" if scheduled else "fixed", cost_table=table, max_batch=max_batch,
                            prefill_budget=prefill_budget, draft_skip=draft_skip, default_gamma=gamma,
                            default_adaptive=draft_length == "auto",
                            skip_prior=self.fitted_survival(gamma) if scheduled else None)

    def fitted_survival(self, gamma: int) -> np.ndarray | None:
        """float64 [gamma] prefix survivals of the model drafter's acceptance fitted on the calibration split
        (``speculation.router``), or None where there is none or the entry is malformed (the router refuses that
        by name; the skip rule just drafts first)."""
        try:
            fitted = router_priors(self.manifest.speculation.router, self.draft_kind).get("inner_stats")
        except ValueError:
            return None
        return None if fitted is None else np.asarray(fitted.survival(0, gamma), dtype=np.float64)

    # -- building one

    def drafter(self, draft, target, confidence_threshold=None, confidence_rule: str = "survival",
                max_batch: int = 8, *, prefix_cache=None, cost_table: dict | None = None) -> Drafter | None:
        """The drafter for a ``draft`` choice over the verifier runner ``target`` (the DSpark drafter reads its
        features), or None for target-only. ``confidence_threshold``: the static-threshold baseline (a probability);
        ``confidence_rule`` (:data:`~dspark_runtime.drafting.dspark.THRESHOLD_RULES`): how the DSpark drafter applies
        it; ``max_batch``: the draft LM runner's requests; ``prefix_cache``: the engine's, for a draft LM on the
        scatter layout; ``cost_table``: given in scheduled mode only (the router scores by expected tokens/s).
        Raises InputError for a bad threshold or rule, a rule other than "survival" with a drafter that is not
        DSpark, a threshold or scheduled mode (``cost_table``) with a DSpark drafter that has no confidence head
        (:meth:`check_confidence`), the errors of :meth:`resolve`, and a malformed router entry in the manifest."""
        if confidence_rule not in THRESHOLD_RULES:
            raise InputError(f"unknown draft_confidence_rule {confidence_rule!r}; choose one of "
                             f"{list(THRESHOLD_RULES)}")
        if confidence_threshold is not None and not (isinstance(confidence_threshold, (int, float))
                                                     and 0.0 <= confidence_threshold <= 1.0):
            raise InputError(f"draft_confidence must be a probability in [0, 1], got {confidence_threshold!r}")
        draft = self.resolve(draft)
        if draft is None:
            return None
        if draft == "router":  # per round, n-gram lookup or the engine's model drafter (DSpark or EAGLE-3: either)
            try:  # n-gram and model-drafter acceptance fitted on the calibration split (dspark-export calibrate)
                priors = router_priors(self.manifest.speculation.router, self.draft_kind)
                others = ["eagle3"] if self.draft_kind == "dspark" and self.eagle3_graph else []
                others_stats = {k: router_priors(self.manifest.speculation.router, k).get("inner_stats")
                                for k in others}
            except ValueError as e:
                raise InputError(f"{self.dir}/manifest.json: speculation.router is malformed ({e}); re-run "
                                 "`dspark-export calibrate` on this engine") from None
            inner = self.drafter(self.draft_kind, target, confidence_threshold, confidence_rule, max_batch,
                                 prefix_cache=prefix_cache)
            return Router(inner, cost_table=cost_table, attended_positions=target.attended_positions, **priors,
                          others=tuple(self.drafter(k, target, max_batch=max_batch) for k in others),
                          others_stats=others_stats)
        if draft == "eagle3":
            if confidence_threshold is not None:
                raise InputError("draft_confidence (a static threshold) is not implemented for the EAGLE-3 drafter; "
                                 "drop it, or use draft='dspark' / 'lm'")
            return Eagle3Drafter(self._backends[self.eagle3_graph].activate(), target, self.eagle3_columns())
        if draft == "dspark":
            if confidence_threshold is not None:
                self.check_confidence("draft_confidence (a static threshold on its confidences)",
                                      "drop draft_confidence")
            if cost_table is not None:
                self.check_confidence("draft_length='scheduled' with draft='dspark' (verify lengths from calibrated "
                                      "survivals)", "use an integer draft_length, or draft='router' (it schedules "
                                      "from learned acceptance)")
            return DSparkDrafter(self._backends[self.dspark_graph].activate(), self.dspark_heads(), target,
                                 confidence_threshold, threshold_rule=confidence_rule)
        if confidence_rule != "survival":
            raise InputError(f"draft_confidence_rule={confidence_rule!r} applies to the DSpark drafter only (draft "
                             f"{draft!r} ends a block after its first draft token below draft_confidence); use "
                             "draft='dspark' or 'router' over a DSpark drafter, or drop the rule")
        if draft == "lm":
            runner = self._loop_runner(self.lm_graph, max_batch)
            return LMDrafter(runner, confidence_threshold, prefix_cache if runner.can_import_kv else None)
        return NgramDrafter()

    def eagle3_columns(self):
        """The target feature columns the EAGLE-3 drafter reads (:func:`~dspark_runtime.drafting.eagle3.
        feature_columns`; None: all of them). Raises ManifestError when the manifest has an EAGLE-3 graph but no
        ``speculation.eagle3`` section, InputError when the target outputs none of its layers."""
        info = self.manifest.speculation.eagle3
        if info is None:
            raise ManifestError(f"{self.dir}/manifest.json has an EAGLE-3 drafter graph ({self.eagle3_graph!r}) but "
                                "no speculation.eagle3 section; re-add it with `dspark-export add-draft`")
        dims = self.manifest.graphs["target"].spec.dims
        try:
            return feature_columns(dims.feature_layers, info.target_layer_ids, dims.hidden_size)
        except DSparkError as e:
            raise InputError(str(e)) from None

    def check_confidence(self, what: str, instead: str) -> None:
        """Raise InputError saying that ``what`` needs the DSpark confidence head where the engine's DSpark drafter
        has none (enable_confidence_head false, as DeepSpec's DFlash drafters); ``instead``: what to do instead."""
        if self.dspark_heads().conf_w is None:
            raise InputError(f"{what} needs the DSpark drafter's confidence head, and this engine's DSpark drafter has "
                             "no confidence head (enable_confidence_head false, as DeepSpec's DFlash drafters); "
                             f"{instead}")

    def dspark_heads(self) -> DSparkHeads:
        """The DSpark Markov/confidence heads (loaded once), with the manifest's STS temperatures. Raises
        ManifestError when the manifest has a DSpark graph but no ``speculation.dspark`` section."""
        if self._heads is None:
            info = self.manifest.speculation.dspark
            if info is None:
                raise ManifestError(f"{self.dir}/manifest.json has a DSpark drafter graph ({self.dspark_graph!r}) but "
                                    "no speculation.dspark section; rebuild it with `dspark-export add-draft`")
            vocab = self.manifest.graphs["target"].spec.dims.vocab_size
            self._heads = DSparkHeads.load(self.dir / info.heads_file, info, vocab, info.sts_temperatures)
        return self._heads
