import pytest

from pipeline.batch.record import BatchRecord, result_file_id, window_seconds


def test_windows():
    assert window_seconds("24h", 86400) == 86400 and window_seconds("90s", 86400) == 90
    for bad in ("25h", "0h", "1 day", 24, None):
        with pytest.raises(ValueError):
            window_seconds(bad, 86400)


def test_a_record_round_trips_and_shows_a_pending_cancel_as_cancelling():
    rec = BatchRecord("batch_1", "t", "file-1", "/v1/completions", "24h", 10, 86410, total=3, completed=1)
    back = BatchRecord.from_json(rec.to_json())
    assert back == rec
    view = back.view(cancel_asked_at=20)
    assert view["status"] == "cancelling" and view["cancelling_at"] == 20 and view["object"] == "batch"
    assert view["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    rec.status = "completed"
    assert rec.view(cancel_asked_at=20)["status"] == "completed"
    assert result_file_id("batch_ab", "output") == "file-ab-output"


def test_a_record_from_a_newer_or_older_writer_still_reads():
    newer = b'{"id":"batch_1","tenant":"t","input_file_id":"f","endpoint":"/v1/completions","completion_window":"1h",' \
            b'"created_at":1,"expires_at":3601,"status":"in_progress","a_field_from_the_future":7}'
    rec = BatchRecord.from_json(newer)
    assert rec.status == "in_progress" and rec.total == 0 and rec.answers_from == -1
