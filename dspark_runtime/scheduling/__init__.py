"""How much each round does, pure: verify lengths (the paper's Algorithm 1 and baselines), the cost table
at a context, chunked-prefill budgets, and whether a round's drafting pass pays."""
