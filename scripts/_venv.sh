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
        "$PYTHON" -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel >&2
    fi
    local stamp="$VENV/.clone-installed$extras"
    # Reinstall when setup.cfg changed since the last install with these extras.
    if [ ! -f "$stamp" ] || [ "$ROOT/setup.cfg" -nt "$stamp" ]; then
        echo "clone: installing the project$extras into $VENV" >&2
        "$VENV/bin/python" -m pip install -q -e "$ROOT$extras" >&2
        touch "$stamp"
    fi
}
