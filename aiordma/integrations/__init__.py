"""Integrations of aiordma with other frameworks, each an optional extra.

* :mod:`aiordma.integrations.dask` — ``rdma://``, a comm backend for Dask
  ``distributed`` (``pip install aiordma[dask]``).

An integration uses only aiordma's public API; importing this package imports
no framework.
"""
