"""OpenAI's Batch API on the durable queue: files and batches kept in Kafka, each line a request.

- :mod:`.record`: a batch's state, what ``GET /v1/batches/{id}`` shows (pure);
- :mod:`.lines`: an input file's lines checked, and the output and error files' lines (pure);
- :mod:`.progress`: which line has its answer, what to submit next, the counts (pure);
- :mod:`.store`: the files and batches topics, read into an index and written;
- :mod:`.driver`: the thread in ``llmq serve`` that runs the batches this process owns.

The HTTP endpoints are in :mod:`pipeline.serve.batch_api`; ``llmq batch`` in :mod:`.cli`.
"""
