#!/usr/bin/env bash
# Installs the Debian packages one make target needs, when missing.
#   .ci/system-deps.sh demo   redis-server (the demo and `kvroute up`)
#   .ci/system-deps.sh test   redis-server, chromium (dashboard test), prometheus (promtool)
# Run as root, or read the apt-get line it prints and run that yourself.
set -euo pipefail
target=${1:-test}
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
case "$target" in
  demo) ;;
  test)
    command -v chromium >/dev/null 2>&1 || need+=(chromium)
    command -v promtool >/dev/null 2>&1 || need+=(prometheus)
    ;;
  *)
    echo "usage: $0 demo|test (got '$target')" >&2
    exit 2
    ;;
esac
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing OS packages for 'make $target': ${need[*]}" >&2
  echo "install them as root: apt-get install -y --no-install-recommends ${need[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
