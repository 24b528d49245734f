# Image for the llmq processes in docker-compose.yml (the broker uses the official apache/kafka image).
# llmq is pure Python, so one stage installs it; the processes run as an unprivileged user.
FROM python:3.11-slim
# A fixed uid/gid, so that volume ownership and a platform's runAsUser can name it.
RUN groupadd --system --gid 10001 llmq \
    && useradd --system --uid 10001 --gid llmq --home-dir /app --no-create-home --shell /usr/sbin/nologin llmq
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY pipeline ./pipeline
# The Avro schemas ship inside the package (pipeline._schemas), found without LLMQ_SCHEMAS_DIR.
COPY schemas ./schemas
RUN pip install --no-cache-dir . && rm -rf /src

WORKDIR /app
# The gateway keeps its table state under .llmq/ in its working directory.
RUN mkdir .llmq && chown llmq:llmq .llmq
USER 10001:10001
ENTRYPOINT []
