"""A vLLM-like model server simulator: OpenAI-compatible HTTP, continuous batching, vLLM's metrics.

Used by the benchmarks and the demo as a stand-in for a real model server whose
behaviour under load (slots, a waiting queue, latency that grows with the batch) is
what llmq's scheduling has to cope with. ``python -m pipeline.simulator --help`` runs one.
"""

from pipeline.simulator.engine import Engine, EngineConfig, Sequence, StepResult
from pipeline.simulator.server import SimulatorConfig, SimulatorServer, ThreadedSimulator
from pipeline.simulator.text import answer_text, count_prompt_tokens

__all__ = ["Engine", "EngineConfig", "Sequence", "SimulatorConfig", "SimulatorServer", "StepResult",
           "ThreadedSimulator", "answer_text", "count_prompt_tokens"]
