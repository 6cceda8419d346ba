"""Workload data is deterministic, in the advertised shapes."""

from bench import datasets as D

SIZE = D.SIZES["tiny"]


def test_small_files_sizes_and_layout():
    files = D.small_files(SIZE)
    assert len(files) == SIZE.files
    assert {f.rsplit("/", 1)[0] for f in files} == set(D.small_dirs(SIZE))
    sizes = [D.small_file_size(i) for i in range(500)]
    assert all(80 * 1024 <= s <= 200 * 1024 for s in sizes)


def test_bytes_are_a_function_of_the_path():
    a = D.expected_bytes("imagenet/train/n0/1.JPEG", 4096)
    assert a == D.expected_bytes("imagenet/train/n0/1.JPEG", 4096)
    assert a != D.expected_bytes("imagenet/train/n0/2.JPEG", 4096)


def test_epoch_orders_are_shuffled_permutations():
    files = D.small_files(SIZE)
    e1, e2 = D.shuffled(files, 1), D.shuffled(files, 2)
    assert sorted(e1) == sorted(files) == sorted(e2)
    assert e1 != e2 and e1 == D.shuffled(files, 1)


def test_random_reads_are_aligned_and_split_by_size_over_shards():
    reads = D.random_reads(SIZE)
    shards = D.shards(SIZE)
    assert len(reads) == SIZE.random_4k + SIZE.random_128k
    for path, offset, length in reads:
        assert offset % length == 0 and offset + length <= SIZE.shard_bytes
        assert path in (shards[0::2] if length == 4096 else shards[1::2])


def test_package_tree_matches_its_module_list():
    files = D.package_files(SIZE)
    for name in D.module_names(SIZE):
        rel = f"{D.PKG_ROOT}/{name.replace('.', '/')}"
        assert f"{rel}.py" in files or f"{rel}/__init__.py" in files
