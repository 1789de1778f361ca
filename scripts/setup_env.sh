#!/usr/bin/env bash
# Prepares a fresh Debian/Ubuntu machine: the -dev packages the build needs and a virtualenv at .venv
# with requirements-dev.txt. Idempotent; re-running it is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
[ -f /usr/include/xxhash.h ] || missing+=(libxxhash-dev)
[ -d /usr/include/gtest ] || missing+=(libgtest-dev)
[ -f /usr/include/openssl/evp.h ] || missing+=(libssl-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.requirements-installed
if [ ! -f "$stamp" ] || ! cmp -s requirements-dev.txt "$stamp"; then
  .venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
  cp requirements-dev.txt "$stamp"
fi
