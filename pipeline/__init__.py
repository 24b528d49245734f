"""llmq: a Kafka pipeline that queues LLM inference requests by priority."""

__version__ = "0.1.0"
