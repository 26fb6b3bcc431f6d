#!/usr/bin/env bash
# Installs Debian's headless browser for the console tests (chromium + chromium-driver), once: when both are
# already on PATH it does nothing. Needs root and Debian's mirrors; CI runs it from .ci/run.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_browser.sh: run as root (apt-get install -y chromium chromium-driver)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# With its recommends (fonts-liberation among them: the same text metrics on every machine); about 35 s.
apt-get install -y -qq chromium chromium-driver >/dev/null
chromium --version
