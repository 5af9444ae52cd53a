"""Command-line tools behind the ``aiordma`` command."""
