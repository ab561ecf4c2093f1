# syntax=docker/dockerfile:1
# Timeslice images, built from this repository (see deploy/README.md):
#   docker build --build-arg VARIANT=cpu  -t timeslice:0.1.0-cpu  .
#   docker build --build-arg VARIANT=cuda -t timeslice:0.1.0-cuda .
# cpu: control worker, `timeslice setup`, `simulated` workloads, the node agent's simulated
#      backend. No torch, so the image stays small.
# cuda: adds the torch and cuda extras: GPU workloads (grpo-toy with device=cuda) and the node
#      agent's cuda-checkpoint backend. The torch wheel the package index serves for Linux x86_64
#      bundles the CUDA runtime; the driver comes from the node (NVIDIA container toolkit), so no
#      CUDA base image is needed.
# Both carry the crypto extra: payload encryption when TIMESLICE_PAYLOAD_KEY is set
# (docs/security.md).

# One base for both stages: the virtual environment is copied across, and its interpreter path
# must exist unchanged in the final stage. Pin by digest too where your registry policy wants it.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
# Overrides the extras VARIANT picks, e.g. "report" for a smaller CPU image.
ARG EXTRAS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
WORKDIR /src
# Only what the package build reads; .dockerignore keeps local venvs and state out.
COPY pyproject.toml README.md ./
COPY client ./client
COPY protocol ./protocol
COPY transport ./transport
COPY cli ./cli
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
COPY snapshot ./snapshot
COPY workloads ./workloads
COPY plan ./plan
COPY report ./report
COPY integrations ./integrations
# A non-editable install: the final image has no /src.
RUN set -eu; \
    case "${VARIANT}" in \
        cpu) extras="report,crypto" ;; \
        cuda) extras="torch,cuda,report,crypto" ;; \
        *) echo "VARIANT must be cpu or cuda, not '${VARIANT}'" >&2; exit 1 ;; \
    esac; \
    /opt/venv/bin/pip install --no-cache-dir "/src[${EXTRAS:-$extras}]"; \
    /opt/venv/bin/timeslice --help > /dev/null

FROM ${PYTHON_IMAGE}
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="timeslice" \
      org.opencontainers.image.description="Co-operative GPU time-slicing for RL post-training jobs, built on Temporal" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.timeslice.variant="${VARIANT}"
# A fixed UID/GID so Kubernetes runAsUser, shared checkpoint volumes and the node agent's
# same-user access to job processes can all name it.
RUN groupadd --system --gid 10001 timeslice \
    && useradd --system --uid 10001 --gid timeslice --create-home --home-dir /home/timeslice \
       --shell /usr/sbin/nologin timeslice
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# Relative defaults (.timeslice/checkpoints, .timeslice/report) land in a writable home.
WORKDIR /home/timeslice
ENTRYPOINT ["timeslice"]
CMD ["--help"]
