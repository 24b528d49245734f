import pytest
from confluent_kafka.admin import AclOperation, ResourcePatternType, ResourceType

from pipeline import acls
from pipeline.config import Settings
from pipeline.errors import ConfigError
from pipeline.security import redact


def test_sasl_ssl_settings_render_for_librdkafka_with_the_password_from_a_file(tmp_path):
    pw = tmp_path / "client.password"
    pw.write_text("s3cret-value\n")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    s = Settings.load(env={"LLMQ_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "LLMQ_KAFKA__SASL_USERNAME": "client",
                           "LLMQ_KAFKA__SASL_PASSWORD_FILE": str(pw), "LLMQ_KAFKA__SSL_CA_LOCATION": str(ca)})
    conf = s.kafka.producer_config()
    assert conf["security.protocol"] == "SASL_SSL"
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
    assert conf["sasl.username"] == "client" and conf["sasl.password"] == "s3cret-value"
    assert conf["ssl.ca.location"] == str(ca)
    assert "ssl.endpoint.identification.algorithm" not in conf  # librdkafka's default (https) stays on
    assert "s3cret" not in repr(s) and "s3cret" not in repr(s.kafka)
    assert "s3cret" not in str(redact(conf))


def test_a_password_in_the_environment_is_never_in_repr():
    s = Settings.load(env={"LLMQ_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "LLMQ_KAFKA__SASL_USERNAME": "u",
                           "LLMQ_KAFKA__SASL_PASSWORD": "hunter2-password"})
    assert "hunter2" not in repr(s)


@pytest.mark.parametrize("env, key", [
    ({"LLMQ_KAFKA__SECURITY_PROTOCOL": "TLS"}, "kafka.security_protocol"),
    ({"LLMQ_KAFKA__SECURITY_PROTOCOL": "SASL_SSL"}, "kafka.sasl_username"),
    ({"LLMQ_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "LLMQ_KAFKA__SASL_USERNAME": "u"}, "kafka.sasl_password_file"),
    ({"LLMQ_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT", "LLMQ_KAFKA__SASL_USERNAME": "u",
      "LLMQ_KAFKA__SASL_PASSWORD": "p", "LLMQ_KAFKA__SASL_MECHANISM": "PLAIN"}, "kafka.sasl_mechanism"),
    ({"LLMQ_KAFKA__SSL_CA_LOCATION": "/nonexistent/ca.pem"}, "kafka.ssl_ca_location"),
])
def test_incomplete_security_settings_are_refused_naming_the_key(env, key):
    with pytest.raises(ConfigError) as info:
        Settings.load(env=env)
    assert info.value.key == key


def test_roles_get_least_privilege_grants():
    s = Settings.load(env={})
    grants = acls.role_grants(s)
    def ops(role, name):
        return {op for g in grants[role] if g.name == name for op in g.operations}
    assert ops("producer", "llm.requests.") == {AclOperation.WRITE, AclOperation.DESCRIBE}
    assert AclOperation.READ not in ops("producer", "llm.responses")
    assert ops("consumer", "llm.responses") == {AclOperation.READ, AclOperation.DESCRIBE}
    assert AclOperation.WRITE not in ops("worker", "llm.requests.")
    assert AclOperation.WRITE in ops("worker", "llm.responses")
    assert all(op == AclOperation.DESCRIBE for g in grants["lagexporter"] for op in g.operations)
    prefixed = [g for g in grants["worker"] if g.resource == ResourceType.TOPIC and g.name.endswith(".")]
    assert prefixed and all(g.pattern == ResourcePatternType.PREFIXED for g in prefixed)
    assert set(grants["client"]) == set(grants["producer"]) | set(grants["consumer"])


def test_aiokafka_gets_the_same_security_settings(tmp_path):
    import ssl

    pw = tmp_path / "gw.password"
    pw.write_text("gw-secret")
    s = Settings.load(env={"LLMQ_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "LLMQ_KAFKA__SASL_USERNAME": "gateway",
                           "LLMQ_KAFKA__SASL_PASSWORD_FILE": str(pw)})
    conf = s.kafka.aiokafka_config()
    assert conf["security_protocol"] == "SASL_SSL" and conf["sasl_mechanism"] == "SCRAM-SHA-512"
    assert conf["sasl_plain_username"] == "gateway" and conf["sasl_plain_password"] == "gw-secret"
    assert conf["ssl_context"].check_hostname and conf["ssl_context"].verify_mode == ssl.CERT_REQUIRED


def test_metric_tenant_labels_are_configurable():
    s = Settings.load(env={"LLMQ_WORKER__METRICS_TENANTS": "acme, globex", "LLMQ_WORKER__METRICS_TENANT_TOP_N": "3"})
    assert s.worker.metrics_tenants == ["acme", "globex"]
    assert s.worker.metrics_tenant_top_n == 3
