"""``llmq tenants set|list|delete``: write and read the registry topic.

``set`` starts from the tenant's current record (``--replace``: from an empty one), changes what
its flags name, validates the result and writes it to ``<prefix>.tenants``; every gateway and
serve process applies it within about a second. API keys are read from files and only their
hashes are written; a generated key goes to a new 0600 file and is never printed.
"""

from __future__ import annotations

import json
import sys

from pipeline.errors import ConfigError, LlmqError
from pipeline.models import now_ms
from pipeline.tenants.keys import fingerprint, generate_key, hash_key, read_key_file, write_key_file
from pipeline.tenants.record import TenantRecord, parse_record
from pipeline.tenants.registry import TenantRegistry


def parse_limit(text: str) -> tuple[str, dict[str, int | str]]:
    """``NAME:window_ms=1000,requests=10[,tokens=..,burst=..,token_burst=..,scope=tenant_model]``."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip() or not rest.strip():
        raise ConfigError("--limit", "expected NAME:window_ms=MS,requests=N[,tokens=N,burst=N,token_burst=N,scope=S]")
    spec: dict[str, int | str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--limit {name}", f"{item!r} is not KEY=VALUE")
        key, value = key.strip(), value.strip()
        if key == "scope":
            spec[key] = value
        else:
            try:
                spec[key] = int(value)
            except ValueError:
                raise ConfigError(f"--limit {name}.{key}", f"{value!r} is not an integer") from None
    return name.strip(), spec


def _band_caps(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        band, eq, value = item.partition("=")
        try:
            out[band.strip().upper()] = int(value)
        except ValueError:
            raise ConfigError("--outstanding", f"{item!r} is not BAND=N") from None
        if not eq:
            raise ConfigError("--outstanding", f"{item!r} is not BAND=N")
    return out


def build_record(current: TenantRecord | None, name: str, args) -> TenantRecord:
    spec = {} if current is None or args.replace else current.to_dict()
    spec.pop("v", None)
    if args.tier is not None:
        spec["tier"] = args.tier
    if args.max_priority is not None:
        spec["max_priority"] = args.max_priority
    if args.any_model:
        spec["models"] = []
    if args.model:
        spec["models"] = list(args.model)
    if args.default_limits:
        spec["limits"] = None
    if args.limit:
        spec["limits"] = dict(parse_limit(text) for text in args.limit)
    if args.outstanding:
        spec["outstanding"] = {**(spec.get("outstanding") or {}), **_band_caps(args.outstanding)}
    if args.weight is not None:
        spec["weight"] = args.weight
    hashes = [] if args.revoke_keys else list(spec.get("key_hashes") or [])
    for path in args.key_file or []:
        hashes.append(hash_key(read_key_file(path)))
    if args.require_signature is not None:
        spec["require_signature"] = args.require_signature
    if args.signing_secret is not None:
        spec["signing_secret"] = args.signing_secret
    if args.enabled is not None:
        spec["enabled"] = args.enabled
    spec["key_hashes"] = hashes
    spec["updated_at"] = now_ms()
    return parse_record(name, spec, f"tenant {name}")


def _describe(record: TenantRecord, source: str) -> dict:
    return {"tenant": record.name, "tier": record.tier, "max_priority": record.max_priority.value,
            "models": list(record.models) or "any", "weight": record.weight,
            "limits": None if record.limits is None else {
                lim.name: {k: v for k, v in record.to_dict()["limits"][lim.name].items() if v not in (0, "tenant")}
                for lim in record.limits},
            "outstanding": dict(record.outstanding), "keys": [fingerprint(h) for h in record.key_hashes],
            "require_signature": record.require_signature, "enabled": record.enabled, "source": source}


def cmd_tenants(settings, args) -> int:
    registry = TenantRegistry(settings)
    if args.action == "list":
        registry.start()
        try:
            rows = [_describe(r, registry.source(r.name)) for r in sorted(registry, key=lambda r: r.name)]
        finally:
            registry.stop()
        if args.json:
            for row in rows:
                print(json.dumps(row))
            return 0
        print(f"{'TENANT':<20} {'TIER':<11} {'MAX':<10} {'MODELS':<22} {'LIMITS':<28} {'KEYS':<18} {'SIGNED':<6} "
              "SOURCE")
        for row in rows:
            limits = "gateway default" if row["limits"] is None else ", ".join(
                f"{n}: " + "/".join(f"{k}={v}" for k, v in spec.items()) for n, spec in row["limits"].items())
            models = row["models"] if isinstance(row["models"], str) else ",".join(row["models"])
            print(f"{row['tenant']:<20} {row['tier']:<11} {row['max_priority']:<10} {models:<22} {limits:<28} "
                  f"{','.join(row['keys']) or '-':<18} {'yes' if row['require_signature'] else 'no':<6} "
                  f"{row['source']}{'' if row['enabled'] else ' (disabled)'}")
        sys.stdout.flush()
        print(f"{len(rows)} tenant{'s' if len(rows) != 1 else ''}", file=sys.stderr)
        return 0
    registry.ensure()
    registry.start()
    try:
        if args.action == "delete":
            if registry.source(args.name) != "topic":
                raise LlmqError(f"tenant {args.name!r} has no record on {registry.topic} "
                                f"({'it comes from the registry file' if registry.get(args.name) else 'unknown'})")
            registry.publish(None, args.name)
            print(f"tenant {args.name}: its record on {registry.topic} deleted")
            return 0
        record = build_record(registry.get(args.name), args.name, args)
        generated = None
        if args.generate_key:
            key = generate_key()
            write_key_file(args.generate_key, key)
            generated = args.generate_key
            record = record.evolve(key_hashes=record.key_hashes + (hash_key(key),))
        others = {h: r.name for r in registry if r.name != record.name for h in r.key_hashes}
        clash = [h for h in record.key_hashes if h in others]
        if clash:
            raise LlmqError(f"a key given is already tenant {others[clash[0]]!r}'s; use another key")
        registry.publish(record)
    finally:
        registry.stop()
    d = _describe(record, "topic")
    print(f"tenant {record.name} written to {registry.topic}: tier {d['tier']}, max priority {d['max_priority']}, "
          f"{len(d['keys'])} key{'s' if len(d['keys']) != 1 else ''}"
          f"{', signed requests only' if record.require_signature else ''}"
          f"{'' if record.enabled else ', DISABLED'}")
    if generated:
        print(f"a new key was written to {generated} (mode 0600); it is not stored anywhere else")
    return 0


def add_parser(command) -> None:
    p = command("tenants", "the tenant registry: tiers, limits, priorities, models, API keys",
                "Tenants' records (pipeline/tenants/record.py documents them) come from [tenants] records, the "
                "[tenants] file, then the compacted topic <prefix>.tenants, which `set` writes. The gateway and "
                "llmq serve follow the topic: a change is in force within about a second, no restart. A tenant "
                "missing from the registry is served as tenant.default_tier (\"standard\") with the gateway's "
                "defaults, unless [tenants] require_known = true refuses it.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = command("set", "create or change a tenant's record (only what the flags name changes)",
                "Reads the tenant's current record, changes what the flags name (--replace: starts from an empty "
                "record), validates and writes it. API keys: --key-file FILE adds the key in FILE (only its "
                "SHA-256 is stored), --generate-key FILE writes a new key to FILE (0600) and adds it, "
                "--revoke-keys drops the keys it had.", parent=actions)
    q.add_argument("name")
    q.add_argument("--tier", help="enterprise, standard, free (the gateway's tier_offsets name them)")
    q.add_argument("--max-priority", help="the highest band it may ask for (higher asks are served there)")
    q.add_argument("--model", action="append", help="a model it may use (repeat); replaces the list")
    q.add_argument("--any-model", action="store_true", help="every model")
    q.add_argument("--limit", action="append", metavar="NAME:window_ms=MS,requests=N[,tokens=N,...]",
                   help="a token bucket (repeat for several); together they replace the tenant's limits")
    q.add_argument("--default-limits", action="store_true", help="use the gateway's [gateway.limits] again")
    q.add_argument("--outstanding", action="append", metavar="BAND=N", help="outstanding cap in a band (0 = none)")
    q.add_argument("--weight", type=float, help="its share against other tenants (default 1)")
    q.add_argument("--key-file", action="append", metavar="FILE", help="add the API key in FILE (repeat)")
    q.add_argument("--generate-key", metavar="FILE", help="generate a key into the new file FILE (0600) and add it")
    q.add_argument("--revoke-keys", action="store_true", help="drop every key it had (before adding new ones)")
    q.add_argument("--require-signature", dest="require_signature", action="store_const", const=True,
                   help="only requests signed with llmq-signature (needs --signing-secret)")
    q.add_argument("--no-require-signature", dest="require_signature", action="store_const", const=False)
    q.add_argument("--signing-secret", metavar="REF", help="env:NAME or file:NAME (in [tenants] secrets_dir)")
    q.add_argument("--disable", dest="enabled", action="store_const", const=False,
                   help="refuse its requests and keys")
    q.add_argument("--enable", dest="enabled", action="store_const", const=True)
    q.add_argument("--replace", action="store_true", help="start from an empty record, not the current one")
    q = command("list", "every tenant's record (keys by fingerprint only)", parent=actions)
    q.add_argument("--json", action="store_true", help="one JSON object per tenant")
    q = command("delete", "delete a tenant's record from the topic (a file record applies again)", parent=actions)
    q.add_argument("name")
    return p
