"""The drafter interface of the decoding loop (:class:`Drafter`) and what a drafter returns (:class:`Proposal`).

A drafter proposes a block for every decoding request of a round in one pass; the loop calls only what
:class:`Drafter` declares. Implementations: :mod:`dspark_runtime.drafting.drafters` (n-gram lookup, a draft LM),
:mod:`dspark_runtime.drafting.dspark` (the DSpark drafter), :mod:`dspark_runtime.drafting.router` (the router).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass
class Proposal:
    """One request's draft for a round: tokens (list[int], l <= γ), q (float [l, vocab] processed draft
    distributions, or None for greedy / point-mass proposals), survival (float64 [l] calibrated prefix
    survivals a_1..a_l of the drafted positions, or None when the drafter has no confidence head)."""

    tokens: list
    q: np.ndarray | None = None
    survival: np.ndarray | None = None


class Drafter(ABC):
    """A drafter of the decoding loop, for one request or many.

    A request (:class:`dspark_runtime.decoding.request.Request`) carries ``rid``, ``prompt``, ``out`` (committed
    tokens, the last one the anchor), ``params`` (sampling) and ``rng`` (its own generator, so a sampled request
    draws the same numbers whatever shares its batch). Class attributes say what a drafter is and can do:

    * ``name``: reported in each request's stats (``GenerationStats.drafter``);
    * ``block_size``: the most tokens one pass drafts for a request (a DSpark block), or None (any γ);
    * ``confident``: proposals carry calibrated prefix survivals (what scheduled verify lengths need);
    * ``reads_target_features``: it reads the target runner's features (a device runner then copies them back).
    """

    name: str = "drafter"
    block_size: int | None = None
    confident: bool = False
    reads_target_features: bool = False

    @abstractmethod
    def begin(self, req) -> None:
        """``req`` joins (its prompt is in the target's cache and its first token committed)."""

    @abstractmethod
    def remove(self, rid) -> None:
        """Request ``rid`` leaves (no-op for an unknown id)."""

    @abstractmethod
    def propose_batch(self, reqs: list, gammas: list, only=None) -> list:
        """One drafting pass: list[:class:`Proposal`] in the order of ``reqs``, request ``reqs[i]`` getting at most
        ``gammas[i]`` tokens after its anchor. Requests outside ``only`` (a set of request ids; None = all) get an
        empty proposal and their random generators are not touched."""

    def observe(self, rid, sent: int, accepted: int) -> None:
        """After verification: the target accepted ``accepted`` of the ``sent`` tokens verified for ``rid``.
        Drafters that learn nothing online ignore it."""

    def source_stats(self, rid) -> dict:
        """{source: {"rounds", "proposed", "accepted"}} of request ``rid`` where a drafter chooses among several
        sources (the router); {} otherwise."""
        return {}
