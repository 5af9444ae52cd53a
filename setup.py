"""Build of the native soft-device engine (the rest of the metadata is in pyproject.toml).

The extension is optional: without a C compiler, Python headers or Cython the
install still succeeds and the soft device runs its Python engine (``aiordma
devices`` and ``aiordma doctor`` say so, and why). ICRC: ISA-L's CRC-32 when
libisal's headers are found (Debian: libisal-dev); without them, a
carry-less-multiply CRC chosen at run time on x86-64 CPUs that have PCLMULQDQ
(as fast), else zlib's, else a portable table (crc32.h).

In a checkout, a second extension is built in place next to it: the test-only RC
core (``tests.native._testing``, from tests/native/_testing.pyx), which the
differential tests drive. It is never built into a wheel (build_ext drops it unless
it builds in place: ``build_ext --inplace``, ``pip install -e``), and the sdist has
no tests/ (MANIFEST.in), so a wheel built from the sdist cannot carry it either.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SRC = "aiordma/providers/soft/_native"
#: the test-only RC core: its source is only in a checkout (MANIFEST.in prunes tests/)
TESTING_MODULE = "tests.native._testing"
TESTING_SRC = "tests/native/_testing.pyx"


def _has_header(name: str) -> bool:
    dirs = ["/usr/include", "/usr/local/include", sys.prefix + "/include"]
    extra = os.environ.get("CPATH", "") + os.pathsep + os.environ.get("C_INCLUDE_PATH", "")
    dirs += [d for d in extra.split(os.pathsep) if d]
    return any(os.path.exists(os.path.join(d, name)) for d in dirs)


def _crc_choice() -> tuple[list[tuple[str, str]], list[str]]:
    """The CRC-32 code to build (macros, libraries): every implementation that
    can be, so that tests compare them all; the fastest is chosen at run time
    (crc32.h). ISA-L and zlib when their headers are there; the PCLMUL code and
    the portable table need none. AIORDMA_NATIVE_CRC, a comma-separated subset
    of isal, pclmul, zlib (the portable table is always built), limits the build
    to those (scripts/wheels: isal,pclmul, so that wheels link no zlib)."""
    raw = os.environ.get("AIORDMA_NATIVE_CRC", "").lower()
    want = {w.strip() for w in raw.split(",") if w.strip()} or {"isal", "pclmul", "zlib"}
    macros: list[tuple[str, str]] = []
    libs: list[str] = []
    if "isal" in want and _has_header("isa-l/crc.h"):
        macros.append(("AIORDMA_HAVE_ISAL", "1"))
        libs.append("isal")
    if "zlib" in want and _has_header("zlib.h"):
        macros.append(("AIORDMA_HAVE_ZLIB", "1"))
        libs.append("z")
    if "pclmul" not in want:
        macros.append(("AIORDMA_CRC_NO_PCLMUL", "1"))
    return macros, libs


def native_extensions() -> list[Extension]:
    if os.environ.get("AIORDMA_NO_NATIVE") == "1":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("aiordma: Cython is not installed: the native soft-device engine is not built", file=sys.stderr)
        return []
    macros, libs = _crc_choice()
    flags = dict(
        include_dirs=[SRC, "aiordma"],
        define_macros=macros,
        libraries=libs + ["pthread"],
        extra_compile_args=["-O2", "-std=gnu11", "-fno-strict-aliasing", "-Wno-unused-function"],
    )
    exts = [
        # the compiled per-operation core of connections (aiordma/core.py chooses it)
        Extension(
            "aiordma._core",
            ["aiordma/_core.pyx"],
            include_dirs=["aiordma"],
            extra_compile_args=["-O2", "-std=gnu11", "-fno-strict-aliasing", "-Wno-unused-function"],
        ),
        Extension(
            "aiordma.providers.soft._native._engine",
            [
                f"{SRC}/_engine.pyx",
                f"{SRC}/wire.c",
                f"{SRC}/crc32.c",
                f"{SRC}/rc.c",
                f"{SRC}/nic.c",
                f"{SRC}/shm.c",
                f"{SRC}/nic_shm.c",
            ],
            **flags,
        ),
    ]
    if os.path.exists(TESTING_SRC):
        # rc.c without the NIC: its own copy of the C core (no symbols shared between extensions)
        exts.append(Extension(TESTING_MODULE, [TESTING_SRC, f"{SRC}/wire.c", f"{SRC}/crc32.c", f"{SRC}/rc.c"], **flags))
    # include_path ".": the test-only core includes the engine's shared .pxi files by
    # their path in the tree; the .pxd files are found by package (includes/__init__.pxd).
    # build_dir: the generated C goes under build/, one folder per interpreter, never next
    # to the .pyx, so builds for several Pythons (scripts/bootstrap --all-pythons runs them
    # at once) never write or read each other's half-written C
    build_dir = os.path.join("build", f"cython-{sys.implementation.cache_tag}")
    return cythonize(exts, language_level=3, quiet=True, include_path=["."], build_dir=build_dir)


class OptionalBuildExt(build_ext):
    """build_ext that leaves the Python engine in place when the native one cannot be
    built (no compiler, no Python headers, a compile error): the install succeeds.
    The test-only RC core is built only in place (see the module's docstring)."""

    def finalize_options(self) -> None:
        super().finalize_options()  # (an editable install turns inplace on here)
        if not self.inplace:
            self.extensions = [e for e in self.extensions if e.name != TESTING_MODULE]

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:
            self._skip(None, e)
        finally:
            self._drop_testing_from_build_lib()

    def _drop_testing_from_build_lib(self) -> None:
        """An in-place build compiles into build_lib and copies to the tree; a later wheel
        build packs all of build_lib: the test-only core must not be left there."""
        built = os.path.join(self.build_lib, self.get_ext_filename(TESTING_MODULE))
        if os.path.exists(built):
            os.remove(built)
            for d in (os.path.dirname(built), os.path.dirname(os.path.dirname(built))):  # tests/native, tests
                try:
                    os.rmdir(d)
                except OSError:
                    break

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:
            self._skip(ext, e)

    @staticmethod
    def _skip(ext: Extension | None, e: BaseException) -> None:
        if ext is not None and ext.name == TESTING_MODULE:
            # the tests that need it fail (tests/unit/rc_harness.py), they do not skip
            print(
                f"aiordma: the test-only RC core {TESTING_MODULE} was not built ({type(e).__name__}: {e})",
                file=sys.stderr,
            )
            return
        print(
            f"aiordma: the native soft-device engine was not built ({type(e).__name__}: {e}); "
            "the soft device will run its Python engine",
            file=sys.stderr,
        )


setup(ext_modules=native_extensions(), cmdclass={"build_ext": OptionalBuildExt})
