from prometheus_client import generate_latest

from pipeline.observability.metrics import TenantLabels, WorkerMetrics, reason_code


def _text(m: WorkerMetrics) -> str:
    return generate_latest(m.registry).decode()


def test_counters_and_histograms_render_in_prometheus_text_format():
    m = WorkerMetrics(pool="realtime")
    m.outcome("HIGH", "completed")
    m.outcome("HIGH", "completed")
    m.waited("HIGH", "tenant-a", 0.003)
    m.waited("HIGH", "tenant-a", 0.2)
    m.waited("HIGH", "tenant-a", 5000)
    text = _text(m)
    assert 'llmq_requests_total{outcome="completed",priority="HIGH"} 2.0' in text
    assert 'llmq_queue_wait_seconds_bucket{le="0.005",priority="HIGH"} 1.0' in text
    assert 'llmq_queue_wait_seconds_bucket{le="0.25",priority="HIGH"} 2.0' in text
    assert 'llmq_queue_wait_seconds_bucket{le="+Inf",priority="HIGH"} 3.0' in text
    assert 'llmq_queue_wait_seconds_count{priority="HIGH"} 3.0' in text
    assert 'llmq_inflight_requests{pool="realtime"} 0.0' in text
    assert "_created" not in text


def test_bucket_bounds_are_inclusive_like_prometheus_le():
    m = WorkerMetrics()
    m.queue_wait.labels("LOW").observe(0.01)
    assert 'llmq_queue_wait_seconds_bucket{le="0.01",priority="LOW"} 1.0' in _text(m)


def test_tenant_labels_are_bounded_to_allow_list_and_top_n():
    labels = TenantLabels(allow=["vip"], top_n=2)
    for _ in range(50):
        labels.label("big-1")
        labels.label("big-2")
    seen = {labels.label(f"tenant-{i}") for i in range(5000)}
    assert seen <= {"other", "big-1", "big-2", "tenant-0", "tenant-1"}
    assert labels.label("vip") == "vip"
    assert labels.label("big-1") == "big-1"


def test_reason_codes_are_short_and_bounded():
    assert reason_code("rate_limited: 10 requests per second") == "rate_limited"
    assert reason_code(None) == "none"
    assert reason_code("weird stuff <script>") == "other"
