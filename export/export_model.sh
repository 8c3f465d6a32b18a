#!/usr/bin/env bash
# Export a trained .keras model into ./exported (SavedModel version + ONNX) and verify it.
#   ./export_model.sh path/to/model.keras encoder
# The SavedModel lands in ./exported/<name>/<version>, the base_path that
# models.config gives TF Serving (mounted at /models/<name>).
# keras-linattn comes from PATH (an activated venv), else from the checkout's
# .venv (what `make demo` / `make install` create).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ $# -lt 2 ]; then
  echo "usage: $0 MODEL.keras NAME [keras-linattn export options]" >&2
  exit 2
fi
if ! command -v keras-linattn >/dev/null 2>&1; then
  if [ -x "$here/../.venv/bin/keras-linattn" ]; then
    PATH="$(cd "$here/../.venv/bin" && pwd):$PATH"
  else
    echo "error: keras-linattn is not on PATH: activate the venv it is installed in (source .venv/bin/activate" \
      "after make demo), or install it from the checkout: pip install -e ." >&2
    exit 2
  fi
fi
model="$1"; name="$2"; shift 2
keras-linattn export "$model" --out "$here/exported" --name "$name" "$@"
keras-linattn verify "$here/exported" --name "$name"
