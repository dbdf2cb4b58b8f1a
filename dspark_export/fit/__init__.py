"""Fitted to a built engine: drafter calibration (STS temperatures, router priors), the round cost table,
and `dspark-export compare` (two engines' agreement)."""
