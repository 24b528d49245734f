# Image for the llmq processes in docker-compose.yml (the broker uses the official apache/kafka image).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY schemas ./schemas
RUN pip install --no-cache-dir .
ENV LLMQ_SCHEMAS_DIR=/app/schemas
ENTRYPOINT []
