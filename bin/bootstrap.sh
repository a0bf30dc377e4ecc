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

# The other-language clients' toolchains (bindings/): Debian's libzmq and msgpack-c
# for the C client, the npm packages for the Node.js client. Installed on first use;
# PPOZ_SKIP_BINDINGS=1 leaves them out (their tests then skip).
ppoz_bootstrap_bindings() {
    [[ "${PPOZ_SKIP_BINDINGS:-}" == "1" ]] && return 0
    local missing=()
    for pkg in libzmq3-dev libmsgpack-dev pkg-config; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        local sudo=""
        [[ $(id -u) -ne 0 ]] && sudo="sudo -n"
        echo "ppoz: installing ${missing[*]} for the C client (Debian packages)" >&2
        if ! { $sudo apt-get install -y -q "${missing[@]}" >&2 || { $sudo apt-get update -q >&2 && $sudo apt-get install -y -q "${missing[@]}" >&2; }; }; then
            echo "ppoz: could not install ${missing[*]}; install them, or set PPOZ_SKIP_BINDINGS=1" >&2
            return 1
        fi
    fi
    if [[ ! -d "$root/bindings/node/node_modules" || "$root/bindings/node/package-lock.json" -nt "$root/bindings/node/node_modules" ]]; then
        if ! command -v npm >/dev/null 2>&1; then
            echo "ppoz: npm is not installed (needed for the Node.js client); install Node.js, or set PPOZ_SKIP_BINDINGS=1" >&2
            return 1
        fi
        echo "ppoz: installing the Node.js client's packages" >&2
        (cd "$root/bindings/node" && npm ci --no-audit --no-fund --ignore-scripts >&2) || return 1
        touch "$root/bindings/node/node_modules"
    fi
}
