#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has no network) into git-ignored folders that
# the device tool carries (see docs/benchmarks-history.md, the serving runs against vLLM):
#   .whl/   kvflow's serving dependencies for the machine's Python 3.12
#   .vwhl/  vLLM 0.26's imports that neither the machine nor the vLLM bundle has
#           (`PARTS=vllm` in scripts/device_serve.sh installs them before the bundle; orjson,
#           which vLLM's /v1/embeddings asks for at start)
set -euo pipefail
cd "$(dirname "$0")/.."
download() {  # DIR PACKAGE...
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --abi abi3 --abi none --platform any \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 -d "$@"
}
# fastapi 0.165 imports opentelemetry; pydantic and pydantic-core must be a matching pair.
download .whl msgspec gguf pyzmq fastapi==0.165.0 starlette uvicorn pydantic==2.13.4 \
    pydantic-core==2.46.4 annotated-types typing-inspection typing_extensions \
    python-multipart opentelemetry-api==1.45.2 llguidance==1.9.1 jsonschema \
    jsonschema-specifications referencing rpds-py attrs httptools
download .vwhl sniffio python-json-logger ijson jsonschema jsonschema-specifications \
    referencing rpds-py lark==1.2.2 anthropic docstring-parser "mistral_common>=1.11.5" \
    pydantic-extra-types pycountry lm-format-enforcer==0.11.3 interegular outlines_core==0.2.14 \
    email-validator dnspython websockets httptools python-dotenv mcp httpx-sse sse-starlette \
    pydantic-settings opentelemetry-sdk opentelemetry-semantic-conventions nvtx==0.2.15 orjson
du -sh .whl .vwhl
