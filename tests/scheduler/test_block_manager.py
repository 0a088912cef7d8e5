import pytest

from sparkrelay.scheduler.block_manager import BlockManager


def test_allocate_grow_free_and_check():
    bm = BlockManager(num_blocks=8, page_size=4)
    assert bm.blocks_needed("a", 9) == 3
    bm.allocate("a", 9)
    bm.check()
    assert bm.num_free == 5 and len(bm.table("a")) == 3
    bm.allocate("a", 12)  # still 3 blocks
    assert len(bm.table("a")) == 3
    bm.allocate("a", 13)
    bm.check()
    assert len(bm.table("a")) == 4
    assert bm.slots("a", 3, 6) == [
        bm.table("a")[0] * 4 + 3,
        bm.table("a")[1] * 4,
        bm.table("a")[1] * 4 + 1,
    ]
    assert bm.free("a") == 4
    bm.check()
    assert bm.num_free == 8 and bm.free("a") == 0


def test_exhaustion_refuses_without_corruption():
    bm = BlockManager(num_blocks=4, page_size=2)
    bm.allocate("a", 6)
    assert not bm.can_allocate("b", 3)
    with pytest.raises(MemoryError):
        bm.allocate("b", 3)
    bm.check()
    assert bm.table("b") == [] and bm.num_free == 1
    assert bm.can_allocate("b", 2)


def test_check_catches_corruption():
    bm = BlockManager(num_blocks=4, page_size=2)
    bm.allocate("a", 2)
    bm._free.append(bm.table("a")[0])  # a block both free and owned
    with pytest.raises(AssertionError):
        bm.check()


def test_owners_lists_every_table_until_freed():
    bm = BlockManager(num_blocks=4, page_size=2)
    bm.allocate("a", 2)
    bm.allocate("b", 3)
    assert sorted(bm.owners()) == ["a", "b"]
    bm.free("a")
    assert bm.owners() == ["b"]
