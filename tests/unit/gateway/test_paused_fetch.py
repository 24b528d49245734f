"""faust pauses a partition only in what it reads; the gateway's fetcher must stop fetching it
too, or its unread records hold every fetch to that broker for aiokafka's prefetch backoff."""


from aiokafka.structs import TopicPartition

from pipeline.gateway.faust_fixes import fetch_only_what_faust_reads


class _State:
    def __init__(self):
        self.paused = False

    def pause(self):
        self.paused = True

    def resume(self):
        self.paused = False


class _Assignment:
    def __init__(self, tps):
        self.tps = set(tps)
        self.states = {tp: _State() for tp in tps}

    def state_value(self, tp):
        return self.states[tp]


class _Fetcher:
    def __init__(self):
        self._records = {}
        self.asked = []

    def _get_actions_per_node(self, assignment):
        self.asked.append({tp for tp in assignment.tps if not assignment.state_value(tp).paused})
        return [], {}, 0.2, False, []


REQUESTS = TopicPartition("llm.requests.normal", 0)
CHANGELOG = TopicPartition("llm-gw-admitted-changelog", 0)


def test_a_partition_faust_paused_is_not_fetched_and_its_unread_records_are_dropped():
    fetcher, faust_paused = _Fetcher(), {CHANGELOG}
    fetcher._records[CHANGELOG] = object()
    fetch_only_what_faust_reads(fetcher, faust_paused)
    fetcher._get_actions_per_node(_Assignment([REQUESTS, CHANGELOG]))
    assert fetcher.asked == [{REQUESTS}]
    assert CHANGELOG not in fetcher._records


def test_a_partition_faust_resumes_is_fetched_again_at_the_next_round():
    fetcher, faust_paused = _Fetcher(), {REQUESTS, CHANGELOG}
    assignment = _Assignment([REQUESTS, CHANGELOG])
    fetch_only_what_faust_reads(fetcher, faust_paused)
    fetcher._get_actions_per_node(assignment)
    faust_paused.discard(REQUESTS)  # recovery done: faust reads the requests again
    fetcher._get_actions_per_node(assignment)
    assert fetcher.asked == [set(), {REQUESTS}]


def test_a_pause_made_by_someone_else_is_left_alone():
    fetcher = _Fetcher()
    assignment = _Assignment([REQUESTS])
    assignment.states[REQUESTS].pause()  # e.g. aiokafka's own user of pause()
    fetch_only_what_faust_reads(fetcher, set())
    fetcher._get_actions_per_node(assignment)
    assert assignment.states[REQUESTS].paused


def test_records_of_partitions_faust_reads_stay_for_it():
    fetcher = _Fetcher()
    kept = fetcher._records[REQUESTS] = object()
    fetch_only_what_faust_reads(fetcher, {CHANGELOG})
    fetcher._get_actions_per_node(_Assignment([REQUESTS, CHANGELOG]))
    assert fetcher._records[REQUESTS] is kept
