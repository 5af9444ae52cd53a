"""The native engine of the soft device (compiled; see ``_engine.pyx`` and the C core
``wire.c``, ``rc.c``, ``nic.c``). Built by ``pip install`` when a C compiler, the
Python headers and Cython are there; :func:`aiordma.providers.soft.engine.native_status`
says whether it imports."""
