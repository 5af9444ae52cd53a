# The C declarations of the native engine's headers, one .pxd per header (the
# layout uvloop uses for libuv's): cimported by _engine.pyx's files and by the
# test-only RC core (tests/native/_testing.pyx). This file makes the directory a
# Cython package.
