#!/usr/bin/env bash
# Everything a run on the lent GPU machine carries, in git-ignored folders of the repo:
#   .whl/   wheels its Python 3.12 image lacks, for serving and benchmarks
#   .whlx/  diffusers (image model runs only)
#   .whlb/  LitServe (the baseline of bench.compare) and py-spy (profiles): calls that use
#           them carry it; without it the tree, .whl, .whlx and .gb fit a call's 64 MiB
#   .whlt/  the few of .whl that training and its evaluation need (formula_continue.sh)
#   .fd/ .gb/  packed data (bench/device/pack_data.py)
# Usage, from the repo root: bash bench/device/bundle.sh [DATA]   (DATA: ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/../.."
for folder in .whl .whlx .whlb .whlt .fd .gb; do
    grep -qx "/$folder/" .git/info/exclude || echo "/$folder/" >> .git/info/exclude
done
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$@"
}
# The device image has torch, huggingface-hub 1.33, tokenizers 0.23, safetensors, httpx,
# numpy, pillow, prometheus-client, psutil (KINDS.md); these are the rest.
download .whl transformers==5.24.0 fastapi starlette uvicorn httptools pydantic pydantic-core \
    pydantic-settings python-dotenv python-multipart annotated-types typing-inspection \
    opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http \
    opentelemetry-exporter-otlp-proto-common opentelemetry-proto \
    opentelemetry-semantic-conventions opentelemetry-instrumentation \
    opentelemetry-instrumentation-fastapi opentelemetry-instrumentation-asgi \
    opentelemetry-util-http googleapis-common-protos asgiref msgspec \
    aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl
download .whlx diffusers==0.42.1 importlib_metadata
download .whlb litserve pyzmq py-spy
mkdir -p .whlt && cp .whl/opentelemetry_api-*.whl .whl/opentelemetry_sdk-*.whl \
    .whl/opentelemetry_semantic_conventions-*.whl .whlx/importlib_metadata-*.whl .whlt/
.venv/bin/python -m bench.device.pack_data --data "${1:-../shared/data}"
du -sh .whl .whlx .whlb .whlt .fd .gb
