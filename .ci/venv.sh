# Sourced by .ci/run: create or reuse a venv outside the clone (~/.cache/rlhflab or
# $RLHFLAB_VENV_CACHE), keyed on the dependency spec, with the dev extras; activate it.
# Bump when the way the venv is built changes (not needed for dependency edits).
RLHFLAB_VENV_RECIPE=1

rlhflab_venv() {
  local key cache venv
  # Key on the dependency spec only, so editing other parts of pyproject.toml
  # (markers, metadata) does not rebuild the venv.
  key=$( { python3.11 -c 'import tomllib,json;p=tomllib.load(open("pyproject.toml","rb"))["project"];print(json.dumps([p["dependencies"],p["optional-dependencies"]],sort_keys=True))'; echo "$RLHFLAB_VENV_RECIPE"; } | sha256sum | cut -c1-16)
  cache="${RLHFLAB_VENV_CACHE:-$HOME/.cache/rlhflab}"
  venv="$cache/venv-$key"
  if [ ! -f "$venv/.complete" ]; then
    echo "[ci] building venv $venv"
    rm -rf "$venv"
    mkdir -p "$cache"
    python3.11 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    # torch first and pinned: anything unpinned would pull a CUDA build.
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q -e ".[dev]"
    "$venv/bin/pip" check
    touch "$venv/.complete"
  else
    echo "[ci] reusing venv $venv"
  fi
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
}
