"""llmq: a Kafka pipeline that queues LLM inference requests by priority."""

__version__ = "0.1.0"
#: The name pip knows this project by (pyproject.toml); the command is `llmq`.
DISTRIBUTION = "llmq-kafka"
