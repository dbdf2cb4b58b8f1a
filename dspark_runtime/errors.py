"""User-facing errors. Every error a user can cause is a ``DSparkError`` whose message names the
problem and the fix; the CLIs print it without a traceback and exit with status 2."""


class DSparkError(Exception):
    """Base class: a problem the user can fix (bad input, missing or corrupted files)."""


class ManifestError(DSparkError):
    """The engine directory or its manifest is missing, corrupted or of an unsupported version."""


class InputError(DSparkError):
    """A generation argument is out of range (empty prompt, max_new_tokens <= 0, ...)."""


class FetchError(DSparkError):
    """A model could not be fetched (missing package part, checksum mismatch, ...)."""
