"""Runners: a verifier graph plus the KV cache of the requests it decodes, one class per KV layout
(growing, packed, scatter, device capacity), behind the one interface the loop drives."""
