"""Integrations of aiordma with other frameworks, each an optional extra.

* :mod:`aiordma.integrations.dask` — ``rdma://``, a comm backend for Dask
  ``distributed`` (``pip install aiordma[dask]``).

An integration uses aiordma's documented modules and no private (underscore)
name of theirs (``tests/unit/test_layering.py`` holds it to that); importing
this package imports no framework.
"""
