# Texel on a CUDA machine: `docker build -t texel . && docker run --gpus all -p 8000:8000 --stop-timeout 50 texel`
# (--stop-timeout: Docker's default 10 s before SIGKILL is shorter than Texel's drain).
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/texel
ENV PATH=/opt/texel/bin:$PATH
WORKDIR /src
# Dependencies first, so code and README changes do not reinstall torch; at the versions
# the tests passed with (deploy/constraints.txt: `make lock`), torch's CUDA build.
COPY pyproject.toml deploy/constraints.txt ./
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/requirements.txt \
 && pip install --upgrade pip && pip install -c constraints.txt torch \
 && pip install -c constraints.txt -r /tmp/requirements.txt
COPY app ./app
COPY batching ./batching
COPY engine ./engine
COPY models ./models
COPY telemetry ./telemetry
COPY README.md ./
RUN pip install --no-deps .

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 curl tini \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 texel
COPY --from=build /opt/texel /opt/texel
ENV PATH=/opt/texel/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TEXEL_LOG_FORMAT=json \
    TEXEL_SHUTDOWN_GRACE_S=5
USER texel
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8000/livez || exit 1
# tini is PID 1: it passes SIGTERM to texel, which drains before exiting, and reaps the
# processes handed to PID 1 (a fork server that dies leaves its children to it, and
# texel's launcher, as PID 1, would leave them zombies).
ENTRYPOINT ["tini", "--", "texel", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
