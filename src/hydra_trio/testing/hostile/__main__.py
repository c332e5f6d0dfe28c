"""The stream reader's own process (``--stream-reader``); the campaign itself is
``python -m benchmarks.hostile``."""

import sys

from .run import main

sys.exit(main())
