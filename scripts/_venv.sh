# Shared by scripts/run and scripts/test: create .venv if missing and install the
# project into it. Sourced, not executed. Honours $CLONE_VENV and $PYTHON.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CLONE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

ensure_venv() {
    # $1: the extras to install, e.g. "" or "[test,spark]"
    local extras="$1"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "clone: creating $VENV" >&2
        # With a pip of its own, the host's Python installs the venv's first
        # pip itself (pip's --python): venv's ensurepip unpacks and compiles a
        # bundled pip only for it to be upgraded next, 3-4 s of a clean
        # clone's run, before any test (docs/testing.md, "Seventeenth pass").
        # Without one (or one older than --python, pip 22.3), venv's own way.
        if "$PYTHON" -m venv --without-pip "$VENV" &&
            "$PYTHON" -m pip --python "$VENV/bin/python" install -q --upgrade pip setuptools wheel >&2 2>/dev/null; then
            :
        else
            # (venv over the half-made one: it adds ensurepip's pip.)
            "$PYTHON" -m venv "$VENV"
            "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel >&2
        fi
    fi
    local stamp="$VENV/.clone-installed$extras"
    # Reinstall when setup.cfg changed since the last install with these extras.
    if _clone_install_stale "$stamp" "$extras"; then
        # One install at a time: the tests start several of these scripts at
        # once, and two pips writing one venv break each other's install.
        exec 9>"$VENV/.clone-install.lock"
        flock 9
        if _clone_install_stale "$stamp" "$extras"; then
            echo "clone: installing the project$extras into $VENV" >&2
            # --no-compile: byte-compiling every installed module (pyspark's
            # thousands) took a third of the install; what is imported is
            # compiled once, when first imported (docs/testing.md).
            "$VENV/bin/python" -m pip install -q --no-compile -e "$ROOT$extras" >&2
            touch "$stamp"
        fi
        flock -u 9
        exec 9>&-
    fi
}

_clone_install_stale() {
    # $1: the stamp of an install with extras $2. Without extras, an install
    # with any extras newer than setup.cfg installed the project too.
    local stamp="$1" extras="$2" other
    if [ -f "$stamp" ] && [ ! "$ROOT/setup.cfg" -nt "$stamp" ]; then
        return 1
    fi
    if [ -z "$extras" ]; then
        for other in "$VENV"/.clone-installed*; do
            if [ -f "$other" ] && [ ! "$ROOT/setup.cfg" -nt "$other" ]; then
                return 1
            fi
        done
    fi
    return 0
}

cache_bytecode_outside_checkout() {
    # Where PYTHONDONTWRITEBYTECODE is set (some CI and sandbox environments
    # set it), every Python process compiles what it imports from source, and
    # pip installs with --no-compile: in a clean clone, importing pytest and
    # its plugins took 0.95 CPU-seconds in each of the run's eight pytest
    # processes (the main one, five workers, two collections), 0.34 with a
    # cache.  tests/support/bytecode.py does the same for everything imported
    # after tests/conftest.py; this covers what comes before it.  The checkout
    # stays free of bytecode, as the variable asks: the cache is Python's
    # mirror tree under PYTHONPYCACHEPREFIX (the same directory as
    # tests/support/bytecode.py's, or the one the environment gives).
    if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
        export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${TMPDIR:-/tmp}/clone-tests-pycache-$(id -u)}"
        unset PYTHONDONTWRITEBYTECODE
    fi
}
