"""The decoding core: the round loop over a set of requests, a request's state and stop rules, the
acceptance rule, sampling, and the prefix KV cache across requests."""
