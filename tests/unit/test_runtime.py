import gc
import weakref

from pipeline.runtime import freeze_long_lived


def test_freezing_keeps_what_exists_out_of_collections_but_collects_garbage_first():
    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # a cycle nothing refers to: collected, not frozen for good
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_long_lived("test")
        # other threads of the session may free frozen objects meanwhile: counts only shrink
        assert 0 < gc.get_freeze_count() <= frozen
        assert gone() is None
    finally:
        gc.unfreeze()
