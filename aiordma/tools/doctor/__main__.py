"""``python -m aiordma.tools.doctor`` = ``aiordma doctor``."""

import sys

from .cli import main

sys.exit(main())
