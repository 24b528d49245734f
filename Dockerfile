# Image for the llmq processes in docker-compose.yml (the broker uses the official apache/kafka image).
# Built in two stages: the first has a C compiler for llmq's optional C extensions (the native
# codec pipeline/serde/_native.c, via setup.py), the second only the wheel it produced.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY pipeline ./pipeline
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && python -c "import sys, zipfile, glob; names = zipfile.ZipFile(glob.glob('/wheels/*.whl')[0]).namelist(); missing = [m for m in ('pipeline/serde/_native',) if not any(n.startswith(m) and n.endswith('.so') for n in names)]; sys.exit('not built: ' + ', '.join(missing) if missing else 0)"

FROM python:3.11-slim
WORKDIR /app
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY schemas ./schemas
ENV LLMQ_SCHEMAS_DIR=/app/schemas
ENTRYPOINT []
