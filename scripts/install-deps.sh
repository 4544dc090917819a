#!/usr/bin/env bash
# Installs the Debian 12 packages this project needs (the only place that lists them).
# Installs only what is missing; uses sudo when not root.
set -euo pipefail
PACKAGES=(
  build-essential pkg-config            # gcc (with ASan and TSan), g++, make
  libsentencepiece-dev sentencepiece    # the tokenizer library and spm_train
  libcmocka-dev                         # C unit tests
  python3 python3-torch python3-sentencepiece python3-numpy python3-tqdm python3-matplotlib python3-pytest
  libopenblas0-pthread                  # fp32 products of python3-torch (~110 GFLOP/s on 2 cores, not
                                        # the reference BLAS's few): training without bf16 instructions
  clang libclang-rt-14-dev              # libFuzzer and sanitizers (make fuzz, make test-asan)
  valgrind
  chromium                              # tests/test_report.py opens make report's page headless
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages are installed"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
