"""Soak and fault test of ``dspark serve`` on loopback: ``soak`` (mixed requests, the server's RSS), ``overload``
(2 x capacity clients: only 200 / 429), ``disconnect`` (clients hanging up), ``capacity`` (prompts at and over the
context limit), ``sigterm`` (requests in flight: each finishes or ends cleanly) and ``fault`` (a damaged weight file
under a running server, on a copy of the engine). Bounded counts and client timeouts: a hung connection shows up
as a timeout. Prints a table, writes --json, exits 1 when an aim is missed.

    python -m benchmarks.soak --engine /tmp/soak/engine --json results/soak-smollm2-135m.json
"""
from benchmarks.soak.phases import (phase_capacity, phase_disconnect, phase_fault, phase_overload,  # noqa: F401
                                    phase_sigterm, phase_soak)
from benchmarks.soak.report import aims, clean_exit, table  # noqa: F401
from benchmarks.soak.server import PROMPTS, READ_TIMEOUT, ServeProcess, mixed_body, request  # noqa: F401
