# shellcheck shell=bash
# Sourced by benchmarks/*_h200.sh, from the repository root on the lent H200 (offline image: python 3.12, torch
# 2.11, triton 3.6, no network). Installs this checkout in place, editable and without dependencies (the image
# brings torch and triton; ray, torchrec and fbgemm-gpu come from ../shared/tools/gpu-stack, installed into
# /tmp/site as its README says), then checks that the `gemray` CLI is this checkout's.
# PY: the interpreter (default python3).
PY=${PY:-python3}
if [ -d /tmp/site ]; then
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
fi
_gemray_here() {  # is gemray (kernels/ included, through the package-dir mapping) imported from this checkout?
  "$PY" -c 'import os, sys, gemray.kernels as k; sys.exit(not os.path.samefile(os.path.dirname(k.__file__), "kernels"))' \
    2>/dev/null
}
if ! _gemray_here; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    || "$PY" -m pip install -q --no-deps --no-build-isolation --break-system-packages -e . \
    || { echo "h200_env.sh: pip install -e . failed" >&2; exit 1; }
  _gemray_here || { echo "h200_env.sh: gemray still does not import from $PWD" >&2; exit 1; }
fi
# the console script lands in the interpreter's scripts folder (or the user one): make sure it is found first
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$("$PY" -m site --user-base)/bin:$PATH"
export PATH
command -v gemray >/dev/null || { echo "h200_env.sh: no gemray CLI on PATH after the install" >&2; exit 1; }
