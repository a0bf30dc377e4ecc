# Sourced by bin/ppoz, bin/test and bin/lock: makes sure a private virtual environment with
# PPOZ installed exists, creating or refreshing it on first use, at the versions of the
# committed lock (constraints.txt) so that every machine gets what the project tested.
#   PPOZ_VENV   where the environment lives (default: .venv in the checkout)
#   PPOZ_PYTHON which interpreter creates it (default: python3.11, else python3)
#   PPOZ_TORCH_SPEC the torch to install on a machine without a GPU (default: the lock's torch,
#               which on a machine without a GPU is the CPU build); another spec drops the
#               lock's torch and its CUDA companions
#   PPOZ_UNLOCKED=1 the newest releases within setup.cfg's ranges instead of the lock
#               (bin/test --latest sets it, in an environment of its own)
root="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # -P: bin/ may be reached through a link
VENV="${PPOZ_VENV:-$root/.venv}"
LOCK="$root/constraints.txt"
stamp="$VENV/.ppoz-installed"

ppoz_bootstrap() {
    local unlocked="${PPOZ_UNLOCKED:-}"
    if [[ -z "$unlocked" && -f "$stamp" && "$stamp" -nt "$root/setup.cfg" && "$stamp" -nt "$LOCK" ]]; then
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
    if [[ -n "$unlocked" ]]; then
        echo "ppoz: setting up $VENV with the newest releases setup.cfg admits (a few minutes)" >&2
    else
        echo "ppoz: setting up $VENV from constraints.txt (first use; a few minutes)" >&2
    fi
    [[ -x "$VENV/bin/python" ]] || "$python" -m venv "$VENV" || return 1
    # -qq: errors only (a machine's own pip settings can warn on every call); an editable install in
    # setuptools' compat mode (a .pth file naming the checkout), which has no warning to print either.
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check install -qq)
    local project=(--config-settings editable_mode=compat -e "$root[dev]")
    # What pins the versions: the lock; or, unlocked, only the lock's torch (the newest releases of
    # everything else are what such a run is for). A torch of the user's choosing takes the lock
    # without torch and the CUDA packages pinned to go with it.
    local constraints="$VENV/constraints-in-use.txt"
    if [[ -n "$unlocked" ]]; then
        grep -E '^torch==' "$LOCK" >"$constraints" || return 1
    elif [[ -n "${PPOZ_TORCH_SPEC:-}" ]]; then
        grep -v -E '^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==' "$LOCK" >"$constraints" || return 1
    else
        cp "$LOCK" "$constraints" || return 1
    fi
    "${pip[@]}" --upgrade pip >&2 || true
    # Without a GPU, take the CPU build of torch first: a plain 'torch' would pull several GB of CUDA
    # packages. The lock names the version; where a CPU build of it lies beside the index (its local
    # label '+cpu' sorts above the plain release), pip takes that one.
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        local torch_spec="torch"
        if ! command -v nvidia-smi >/dev/null 2>&1; then
            torch_spec="${PPOZ_TORCH_SPEC:-torch}"
        fi
        "${pip[@]}" -c "$constraints" "$torch_spec" >&2 || return 1
    fi
    if [[ -n "$unlocked" ]]; then
        "${pip[@]}" -c "$constraints" --upgrade --upgrade-strategy eager "${project[@]}" >&2 || return 1
    else
        "${pip[@]}" -c "$constraints" "${project[@]}" >&2 || return 1
    fi
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
