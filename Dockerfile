# Image for the llmq processes in docker-compose.yml (the broker uses the official apache/kafka image).
# llmq is pure Python, so one stage installs it; the processes run as an unprivileged user.
FROM python:3.11-slim
# A fixed uid/gid, so that volume ownership and a platform's runAsUser can name it.
RUN groupadd --system --gid 10001 llmq \
    && useradd --system --uid 10001 --gid llmq --home-dir /app --no-create-home --shell /usr/sbin/nologin llmq
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
RUN pip install --no-cache-dir . && rm -rf /src

WORKDIR /app
COPY schemas ./schemas
# The gateway keeps its table state under .llmq/ in its working directory.
RUN mkdir .llmq && chown llmq:llmq .llmq
ENV LLMQ_SCHEMAS_DIR=/app/schemas
USER 10001:10001
ENTRYPOINT []
