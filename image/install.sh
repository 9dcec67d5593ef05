#!/bin/sh
# Installs policyd into a new virtual environment VENV from the source tree SOURCE,
# with exactly the versions of SOURCE/requirements.lock, each checked against its
# hashes. The image's build stage (Dockerfile) runs it, and so does tests/image, which
# builds the image's file system without a container runtime: one list of steps.
#
#   PYTHON=python3 sh image/install.sh SOURCE VENV
#
# The steps are make install's (docs/development.md) for the runtime lock, with
# policyd itself installed as a package rather than in place; pip leaves last, so
# the image holds no installer.
set -eu
source_dir=$1
venv=$2
"${PYTHON:-python3}" -m venv "$venv"
pip="$venv/bin/python -m pip --disable-pip-version-check --quiet"
$pip install --require-hashes -r "$source_dir/requirements.lock"
$pip install --no-deps "$source_dir"
# xds-protos ships an old copy of the OpenTelemetry protos in the same files as
# opentelemetry-proto; the OTLP exporters need opentelemetry-proto's.
# Its entry of the lock (version and hashes) goes in again by itself.
proto="$venv/opentelemetry-proto.txt"
awk '/^opentelemetry-proto==/ {on = 1; print; next} on && /^ +--hash/ {print; next} {on = 0}' \
  "$source_dir/requirements.lock" > "$proto"
$pip install --force-reinstall --no-deps --require-hashes -r "$proto"
rm "$proto"
$pip check
$pip uninstall --yes pip
