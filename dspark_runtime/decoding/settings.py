"""What a decoding loop runs with (:class:`LoopSettings`): resolved and validated once, when it is made, and read-only
afterwards. ``Engine.batch`` derives one from its arguments and the engine's drafter; tests build their own."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark_runtime.errors import InputError
from dspark_runtime.scheduling.cost_table import check_cost_table
from dspark_runtime.scheduling.prefill import DEFAULT_PREFILL_BUDGET

MODES = ("fixed", "scheduled")


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@dataclass(frozen=True)
class LoopSettings:
    """The settings of a :class:`~dspark_runtime.decoding.loop.DecodingLoop`.

    Attributes:
        mode: "fixed" (verify min(γ, drafted) tokens) or "scheduled" (the paper's Algorithm 1 over every request's
            calibrated prefix survivals and ``cost_table``; needs a drafter with a confidence head).
        cost_table: the manifest's ``speculation.cost_table`` dict, or None: needed for "scheduled"; the auto prefill
            budget and the skip rule read it at each round's attended positions.
        max_batch: most requests decoding or being prefilled at once; more wait and join between rounds.
        prefill_budget: prompt tokens fed per round while others decode (an int >= 1), or "auto":
            :func:`~dspark_runtime.scheduling.prefill.prefill_budget` of the cost table at each round's context (a
            runner with ``fixed_call_shapes``: its ``max_chunk``); None: ``DEFAULT_PREFILL_BUDGET``.
        draft_skip: rounds skip the drafting pass when it is not expected to pay
            (:mod:`dspark_runtime.scheduling.draft_skip`); None resolves to ``mode == "scheduled"``.
        default_gamma, default_adaptive: a request's draft-length cap and heuristic schedule unless it says.
        skip_prior: float64 [γ] survivals the skip rule assumes for a request that has not drafted yet, or None.
    Raises InputError for an unknown mode, "scheduled" without a cost table, a malformed table, a bad max_batch,
    prefill_budget or default_gamma.
    """

    mode: str = "fixed"
    cost_table: dict | None = field(default=None, compare=False)
    max_batch: int = 8
    prefill_budget: int | str | None = None
    draft_skip: bool | None = None
    default_gamma: int = 5
    default_adaptive: bool = False
    skip_prior: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.cost_table:
            try:
                check_cost_table(self.cost_table)
            except ValueError as e:
                raise InputError(str(e)) from None
        budget = DEFAULT_PREFILL_BUDGET if self.prefill_budget is None else self.prefill_budget
        if budget != "auto" and not _positive_int(budget):
            raise InputError(f"prefill_budget must be a positive integer (prompt tokens per round) or 'auto', got "
                             f"{budget!r}")
        if self.mode not in MODES:
            raise InputError(f"unknown verify-length mode {self.mode!r}: use 'fixed' or 'scheduled'")
        if self.mode == "scheduled" and not self.cost_table:
            raise InputError("scheduled verify lengths need the engine's cost table; run `dspark-export profile`")
        if not _positive_int(self.max_batch):
            raise InputError(f"max_batch must be a positive integer, got {self.max_batch!r}")
        if not _positive_int(self.default_gamma):
            raise InputError(f"gamma must be a positive integer, got {self.default_gamma!r}")
        object.__setattr__(self, "prefill_budget", budget)
        object.__setattr__(self, "draft_skip", self.mode == "scheduled" if self.draft_skip is None
                           else bool(self.draft_skip))
        object.__setattr__(self, "default_adaptive", bool(self.default_adaptive))
        if self.skip_prior is not None:
            object.__setattr__(self, "skip_prior", np.asarray(self.skip_prior, dtype=np.float64))
