# Sourced by scripts/bootstrap and scripts/wheels: the supported Python versions,
# where to find an interpreter for each, and waiting for the jobs run for them at once.
# shellcheck shell=bash

SUPPORTED=(3.11 3.12 3.13) # keep in step with README.md ("Supported Python versions") and pyproject's classifiers

# minor_of PYTHON: its "3.NN", or nothing when it does not run
minor_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

# find_python 3.NN: the interpreter to use for that minor version, or nothing
find_python() {
    local v=$1 cand root=${PYENV_ROOT:-$HOME/.pyenv}
    # pyenv's own installs first (its shims on PATH may point at another version)
    for cand in $(ls -d "$root"/versions/"$v".[0-9]* 2>/dev/null | sort -rV); do
        case ${cand##*/} in *[!0-9.]*) continue ;; esac # 3.13.0t (free-threaded), 3.12.0rc1: not these
        if [ -x "$cand/bin/python$v" ] && [ "$(minor_of "$cand/bin/python$v")" = "$v" ]; then
            echo "$cand/bin/python$v"
            return
        fi
    done
    cand=$(command -v "python$v" 2>/dev/null || true)
    if [ -n "$cand" ] && [ "$(minor_of "$cand")" = "$v" ]; then
        echo "$cand"
    fi
}

# wait_all PID...: wait for every one of these background jobs; fails when any of
# them failed (each says why itself), after all of them have ended
wait_all() {
    local pid failed=0
    for pid in "$@"; do
        wait "$pid" || failed=1
    done
    return "$failed"
}
