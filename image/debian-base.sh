#!/usr/bin/env bash
# Build a stand-in for the Dockerfile's base image from Debian's packages, for machines
# that cannot pull one (no registry but Debian's and PyPI reachable).
#
#   image/debian-base.sh [SUITE]    (root; needs mmdebstrap and buildah; SUITE: bookworm)
#
# mmdebstrap (https://manpages.debian.org/bookworm/mmdebstrap/mmdebstrap.1.en.html)
# bootstraps a minbase Debian with python3, pip and ca-certificates; the tarball becomes
# a one-layer image, tagged under the Dockerfile's FROM name (docker.io/library/...) so
# that `buildah build --pull=never` uses it, and also as localhost/python-debian:<suite>.
#
# It is NOT the official python:3.11-slim: that one carries CPython built from source
# under /usr/local, this one Debian's python3 package (bookworm: 3.11.2) under /usr, with
# Debian's pip and without Debian's EXTERNALLY-MANAGED marker (PEP 668), so that the
# Dockerfile's `pip install` behaves as in the official image. The script checks that
# its Python has the FROM tag's minor version and stops otherwise.
set -euo pipefail

suite="${1:-bookworm}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
from="$(awk 'toupper($1) == "FROM" {print $2; exit}' "$root/Dockerfile")"
want_minor="$(sed -nE 's/^python:([0-9]+\.[0-9]+)-slim.*/\1/p' <<<"$from")"
if [[ -z $want_minor ]]; then
  echo "image/debian-base.sh: the Dockerfile's FROM ($from) is not python:X.Y-slim;" \
    "teach this script its stand-in" >&2
  exit 2
fi
for tool in mmdebstrap buildah; do
  command -v "$tool" >/dev/null || {
    echo "image/debian-base.sh: $tool not found; install it: apt-get install -y $tool" >&2
    exit 2
  }
done

# The host's apt sources (deb822 or one-line), so the bootstrap uses the mirror apt
# already reaches; mmdebstrap takes a file as its MIRROR argument.
sources=""
for candidate in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
  if [[ -s $candidate ]]; then sources="$candidate"; break; fi
done

work="$(mktemp -d)"
ctr=""
cleanup() {
  [[ -n $ctr ]] && buildah rm "$ctr" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# merged-usr hook: bookworm's /usr merge without the usrmerge package (and its perl).
# path-exclude: no manuals, translations or docs besides copyright, as Debian's -slim
# images. The customize hook drops PEP 668's marker (the official image has none).
mmdebstrap --quiet --variant=minbase \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --include=python3,python3-pip,python-is-python3,ca-certificates \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
  --format=tar "$suite" "$work/rootfs.tar" ${sources:+"$sources"}

ctr="$(buildah from scratch)"
buildah add --quiet "$ctr" "$work/rootfs.tar" / >/dev/null
buildah config \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 \
  --cmd python3 \
  --label "org.opencontainers.image.description=Debian $suite minbase with Debian's python3 and pip, built by mmdebstrap (image/debian-base.sh): a stand-in for $from" \
  "$ctr"
have_minor="$(buildah run --isolation chroot "$ctr" -- python3 -c \
  'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ $have_minor != "$want_minor" ]]; then
  echo "image/debian-base.sh: Debian $suite's python3 is $have_minor, the Dockerfile's" \
    "FROM wants $want_minor; pick the suite that ships $want_minor" >&2
  exit 1
fi
buildah commit --quiet --rm "$ctr" "localhost/python-debian:$suite" >/dev/null
ctr=""
buildah tag "localhost/python-debian:$suite" "docker.io/library/$from"
echo "base image: docker.io/library/$from = localhost/python-debian:$suite" \
  "(Debian $suite, python3 $have_minor)"
