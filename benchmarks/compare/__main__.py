"""``python -m benchmarks.compare``: see the package docstring (``--help``)."""
import sys

from benchmarks.compare.run import main

sys.exit(main())
