"""``python -m aiordma.tools.bench`` = ``aiordma bench`` (the server ends run this way)."""

import sys

from .cli import main

sys.exit(main())
