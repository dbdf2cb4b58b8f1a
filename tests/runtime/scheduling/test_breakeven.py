"""dspark_runtime/scheduling/breakeven.py: one request's expected speedup at given survivals, and the acceptance a
drafter needs for a speedup, priced by a cost table."""
import numpy as np
import pytest

from dspark_runtime.scheduling.breakeven import needed_alpha, speedup, tau_fixed


def table(t_verify, t_draft):
    """A manifest cost table (one context) with t_verify[B - 1] for B = 1..len."""
    tokens = list(range(1, len(t_verify) + 1))
    return {"tokens": tokens, "t_verify": list(t_verify), "t_draft": t_draft,
            "seconds": [t_draft + t for t in t_verify]}


def test_a_flat_verify_cost_pays_the_whole_block():
    """Verifying 8 tokens costs what 1 does and drafting is free: the speedup is the expected accepted length."""
    t = table([0.03] * 8, 1e-9)
    l, x = speedup(t, 0.5 ** np.arange(1, 8), context=0, t_draft_s=1e-9)
    assert l == 7 and x == pytest.approx(1 + sum(0.5 ** j for j in range(1, 8)), rel=1e-6)
    # 1.6x needs sum_j alpha^j = 0.6 over 7 positions: alpha ~ 0.376
    alpha = needed_alpha(t, 1.6, context=0, t_draft_s=1e-9)
    assert sum(alpha ** j for j in range(1, 8)) == pytest.approx(0.6, abs=1e-3)


def test_a_compute_bound_verifier_never_pays():
    """Verifying B tokens costs B passes: even alpha = 1 only breaks even, so any gain is unreachable."""
    t = table([0.03 * b for b in range(1, 9)], 0.002)
    assert needed_alpha(t, 1.01, context=0) is None
    assert speedup(t, np.ones(7), context=0)[1] < 1.0


def test_a_dearer_drafting_pass_needs_more_acceptance():
    t = table([0.033, 0.043, 0.057, 0.072, 0.083, 0.096, 0.107, 0.120], 0.006)
    cheap, dear = (needed_alpha(t, 1.3, context=0, t_draft_s=td) for td in (0.006, 0.012))
    assert 0 < cheap < dear < 1
    assert tau_fixed(1.0) == 8.0 and tau_fixed(0.0) == 1.0


def test_survivals_of_the_wrong_shape_and_an_unprofiled_table_are_refused():
    t = table([0.03] * 4, 0.002)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        speedup(t, [], context=0)
    with pytest.raises(ValueError, match="dspark-export profile"):
        speedup({"tokens": [1], "seconds": [0.03]}, [0.5], context=0)


def test_calibrate_prices_the_measured_survivals_on_the_cost_table():
    """dspark-export calibrate's report line: the drafter's measured survivals priced by the engine's cost table."""
    from dspark_export.fit.calibrate_drafter import drafter_worth

    t = table([0.03] * 8, 0.003)  # verifying more tokens is free; a drafting pass costs a tenth of a step
    w = drafter_worth(t, [0.5, 0.25, 0.125, 0.0625])
    assert w["verify_length"] == 4 and w["speedup"] == pytest.approx((1 + 0.9375) / 1.1, abs=1e-4)
    assert w["breakeven_alpha"] == pytest.approx(needed_alpha(t, 1.0, gamma=4), abs=1e-4)
    assert drafter_worth(None, [0.5]) is None and drafter_worth(t, []) is None
