# Sourced by bin/ppoz and bin/test: makes sure a private virtual environment with
# PPOZ installed exists, creating or refreshing it on first use.
#   PPOZ_VENV   where the environment lives (default: .venv in the checkout)
#   PPOZ_PYTHON which interpreter creates it (default: python3.11, else python3)
#   PPOZ_TORCH_SPEC the torch to install on a machine without a GPU (default: torch==2.13.0, the CPU build)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PPOZ_VENV:-$root/.venv}"
stamp="$VENV/.ppoz-installed"

ppoz_bootstrap() {
    if [[ -f "$stamp" && "$stamp" -nt "$root/setup.cfg" ]]; then
        return 0
    fi
    local python="${PPOZ_PYTHON:-}"
    if [[ -z "$python" ]]; then
        python="$(command -v python3.11 || command -v python3)"
    fi
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        echo "ppoz: needs Python 3.10 or newer, $python is $("$python" -V 2>&1)" >&2
        return 1
    fi
    echo "ppoz: setting up $VENV (first use; a few minutes)" >&2
    [[ -x "$VENV/bin/python" ]] || "$python" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2 || true
    # Without a GPU, take the CPU build of torch first: a plain 'torch' would pull
    # several GB of CUDA packages.
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1; then
            "$VENV/bin/python" -m pip install -q torch >&2
        else
            "$VENV/bin/python" -m pip install -q "${PPOZ_TORCH_SPEC:-torch==2.13.0}" >&2
        fi
    fi
    "$VENV/bin/python" -m pip install -q -e "$root[dev]" >&2
    touch "$stamp"
}
