#!/usr/bin/env bash
# CI job: the transformers integration, the trainer tests and `cpshard parity --model llama`
# against other releases of transformers / TRL / accelerate than the pinned ones:
#   newest   the newest releases, resolved now (what `pip install cpshard[trl]` gives a user today)
#   minimum  the oldest releases cpshard declares (pyproject.toml's `test` extra: `name>=X` -> X)
# Usage: .ci/hf_releases.sh newest|minimum BASE_VENV NEW_VENV [pytest paths...]
# The new environment sits on top of BASE_VENV (which has torch, the test tools and cpshard built
# in place): it holds only the Hugging Face releases and what they need beyond the base, so no
# torch is installed again and nothing is rebuilt. torch stays the base's version.
set -euo pipefail
cd "$(dirname "$0")/.."
which=$1 base=$2 new=$3
shift 3
paths=("$@")
[ ${#paths[@]} -gt 0 ] || paths=(tests/integrations tests/parity)

base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$new"
python3 -m venv "$new"
new_site=$("$new/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# site.addsitedir also runs the base's .pth files (the editable cpshard install among them).
echo "import site; site.addsitedir('$(cd "$base_site" && pwd)')" >"$new_site/base-venv.pth"

torch_pin=$("$base/bin/python" -c 'import torch; print(torch.__version__)')
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_pin" >"$constraints"
case "$which" in
  newest) wanted=(--upgrade transformers trl accelerate) ;;
  minimum)
    mapfile -t wanted < <("$new/bin/python" - <<'EOF'
import re, tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]
for spec in extra:
    m = re.fullmatch(r"(transformers|trl|accelerate)>=([0-9.]+)", spec.replace(" ", ""))
    if m:
        print(f"{m[1]}=={m[2]}")
EOF
    )
    [ ${#wanted[@]} -eq 3 ] || { echo "hf_releases: pyproject's test extra lacks a minimum: ${wanted[*]}" >&2; exit 2; } ;;
  *) echo "usage: $0 newest|minimum BASE_VENV NEW_VENV [pytest paths...]" >&2; exit 2 ;;
esac
if [ "$which" = minimum ] && [ -z "$(printf '%s\n' "${wanted[@]}" | grep -vxFf requirements-dev.txt)" ]; then
  echo "hf_releases: the declared minimums (${wanted[*]}) are requirements-dev.txt's pins: the CPU job ran them"
  exit 0
fi
PIP_CONSTRAINT="$constraints" "$new/bin/pip" install -q "${wanted[@]}"
"$new/bin/python" - <<'EOF'
import importlib.metadata as m
import torch
print("hf_releases:", ", ".join(f"{n} {m.version(n)}" for n in ("transformers", "trl", "accelerate", "datasets")),
      f"(torch {torch.__version__})")
EOF
"$new/bin/python" -m cpshard env | tail -n +2
"$new/bin/python" -m cpshard parity --model LlamaForCausalLM --json "$new/parity.json"
"$new/bin/python" -m pytest -q -p no:cacheprovider "${paths[@]}"
