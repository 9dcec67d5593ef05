# policyd's image: docker build -t registry.example.com/policyd:0.1.0 .
# (the tag is pyproject.toml's version, the Helm chart's appVersion; docs/deployment.md).
#
# The build stage installs policyd and the exact versions of requirements.lock into
# the virtual environment /opt/policyd (image/install.sh, the steps tests/image runs
# without a container runtime). The final stage is that environment on a distroless
# Python: Debian 12's Python 3.11, no shell, no package manager, no compiler, no pip,
# running as the non-root UID 65532 the manifests' securityContext names.

FROM debian:12-slim AS build
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md requirements.lock /src/
COPY policyd /src/policyd
COPY image/install.sh /src/image/install.sh
RUN PIP_NO_CACHE_DIR=1 PYTHON=python3 sh /src/image/install.sh /src /opt/policyd

FROM gcr.io/distroless/python3-debian12:nonroot
COPY --from=build /opt/policyd /opt/policyd
ENV PATH=/opt/policyd/bin:/usr/local/bin:/usr/bin:/bin
USER 65532:65532
ENTRYPOINT ["policyd"]
