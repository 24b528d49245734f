"""The published Avro schemas, as the package ``pipeline._schemas``.

pyproject.toml maps this directory to that package name, so that the wheel carries the schemas and
``importlib.resources`` finds them in an installed llmq as in an editable checkout
(pipeline/serde/schema_store.py); this file only makes the directory importable.
"""
