"""Tenants: who sends a request, what it may ask for, and how that is checked.

* :mod:`pipeline.tenants.record`   — :class:`TenantRecord`, its table format and validation;
* :mod:`pipeline.tenants.registry` — :class:`TenantRegistry`: file + live compacted topic;
* :mod:`pipeline.tenants.policy`   — :func:`authorize`, the pure decision (tier, priority cap,
  models, signatures) the gateway and ``llmq serve`` share;
* :mod:`pipeline.tenants.keys`     — API keys (only their SHA-256 hashes are stored);
* :mod:`pipeline.tenants.signing`  — the ``llmq-signature`` HMAC and secret references;
* :mod:`pipeline.tenants.cli`      — ``llmq tenants set|list``.
"""

from pipeline.tenants.policy import Authorization, TenantPolicy, authorize
from pipeline.tenants.record import TenantRecord
from pipeline.tenants.registry import TenantRegistry

__all__ = ["Authorization", "TenantPolicy", "TenantRecord", "TenantRegistry", "authorize"]
