"""Fashion-MNIST fetching and reading, on local folders and a loopback mirror only."""
from __future__ import annotations

import gzip
import hashlib

import numpy as np
import pytest

from dpbook import data
from helpers import serve_folder

DEAD_MIRROR = "http://127.0.0.1:9/"   # the discard port: connection refused, no network


def idx_bytes(array: np.ndarray) -> bytes:
    header = b"\x00\x00\x08" + bytes([array.ndim])
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes(), mtime=0)


@pytest.fixture
def fake_dataset(tmp_path, monkeypatch):
    """Tiny files in the official format, with their hashes swapped into data.FILES."""
    rng = np.random.default_rng(0)
    arrays = {"train-images-idx3-ubyte.gz": rng.integers(0, 256, (6, 28, 28)),
              "train-labels-idx1-ubyte.gz": np.arange(6) % 10,
              "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (4, 28, 28)),
              "t10k-labels-idx1-ubyte.gz": np.arange(4)}
    source = tmp_path / "mirror"
    source.mkdir()
    files = {}
    for name, array in arrays.items():
        blob = idx_bytes(array)
        (source / name).write_bytes(blob)
        files[name] = hashlib.sha256(blob).hexdigest()
    monkeypatch.setattr(data, "FILES", files)
    return source, arrays


@pytest.fixture
def mirror(fake_dataset):
    """Serve the fake files over HTTP on 127.0.0.1, counting requests."""
    source, _ = fake_dataset
    requests = []
    with serve_folder(source, requests) as url:
        yield url, requests


def test_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("DPBOOK_DATA", raising=False)
    default = data.data_dir()
    assert default.name == "fashion-mnist" and "dpbook" in str(default)
    monkeypatch.setenv("DPBOOK_DATA", str(tmp_path))
    assert data.data_dir() == tmp_path
    assert data.data_dir(tmp_path / "x") == tmp_path / "x"   # the argument wins


def test_download_tries_mirrors_in_order(tmp_path, fake_dataset, mirror):
    url, requests = mirror
    cache = tmp_path / "cache"
    X_train, y_train, X_test, y_test = data.read_fashion_mnist(cache, [DEAD_MIRROR, url])
    _, arrays = fake_dataset
    assert X_train.dtype == np.uint8 and X_train.shape == (6, 28, 28)
    np.testing.assert_array_equal(X_test, arrays["t10k-images-idx3-ubyte.gz"])
    np.testing.assert_array_equal(y_train, arrays["train-labels-idx1-ubyte.gz"])
    assert sorted(p.name for p in cache.iterdir()) == sorted(data.FILES)  # no temp files left
    # A second read uses the cache: no new request.
    count = len(requests)
    data.read_fashion_mnist(cache, [url])
    assert len(requests) == count


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_cached_file_is_replaced(tmp_path, fake_dataset, mirror, damage):
    url, requests = mirror
    cache = tmp_path / "cache"
    data.fetch_fashion_mnist(cache, [url])
    victim = cache / "train-images-idx3-ubyte.gz"
    good = victim.read_bytes()
    bad = good[: len(good) // 2] if damage == "truncate" else bytes([good[0] ^ 1]) + good[1:]
    victim.write_bytes(bad)
    count = len(requests)
    data.fetch_fashion_mnist(cache, [url])
    assert victim.read_bytes() == good
    assert len(requests) == count + 1            # only the damaged file was fetched again


def test_offline_without_a_copy_is_one_clear_error(tmp_path, fake_dataset):
    cache = tmp_path / "empty"
    with pytest.raises(data.DataUnavailableError) as err:
        data.read_fashion_mnist(cache, [DEAD_MIRROR, "http://127.0.0.1:9/other/"])
    message = str(err.value)
    for name in data.FILES:
        assert name in message
    assert DEAD_MIRROR + "train-images-idx3-ubyte.gz" in message
    assert "http://127.0.0.1:9/other/t10k-labels-idx1-ubyte.gz" in message
    assert "DPBOOK_DATA" in message and str(cache) in message


def test_offline_corrupt_copy_is_never_used(tmp_path, fake_dataset):
    source, _ = fake_dataset
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in data.FILES:
        (cache / name).write_bytes((source / name).read_bytes())
    (cache / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(data.DataUnavailableError, match="(?s)1 file.*t10k-labels.*does not match.*not used"):
        data.read_fashion_mnist(cache, [DEAD_MIRROR])


def test_wrong_bytes_from_a_mirror_leave_no_file(tmp_path, fake_dataset, mirror, monkeypatch):
    url, _ = mirror
    files = dict(data.FILES)
    files["train-labels-idx1-ubyte.gz"] = "0" * 64          # the mirror's copy will not match
    monkeypatch.setattr(data, "FILES", files)
    cache = tmp_path / "cache"
    with pytest.raises(data.DataUnavailableError, match="train-labels"):
        data.fetch_fashion_mnist(cache, [url])
    assert not (cache / "train-labels-idx1-ubyte.gz").exists()
    assert (cache / "train-images-idx3-ubyte.gz").exists()  # the good files were kept


def test_read_only_folder_with_valid_files_is_used_in_place(tmp_path, fake_dataset):
    source, _ = fake_dataset
    source.chmod(0o555)
    try:
        X_train, *_ = data.read_fashion_mnist(source, [DEAD_MIRROR])
        assert X_train.shape == (6, 28, 28)
    finally:
        source.chmod(0o755)


def test_subset_is_deterministic():
    X = np.arange(100).reshape(100, 1)
    y = np.arange(100)
    a = data.subset(X, y, 10, seed=0)
    b = data.subset(X, y, 10, seed=0)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[0][:, 0], a[1])          # rows stay paired
    assert list(a[1]) == sorted(a[1]) and len(set(a[1])) == 10
    assert data.subset(X, y, None)[0] is X and data.subset(X, y, 1000)[0] is X
    with pytest.raises(ValueError):
        data.subset(X, y, 0)


@pytest.mark.parametrize("drop_last, lengths", [(False, [4, 4, 2]), (True, [4, 4])])
def test_array_loader(drop_last, lengths):
    X, y = np.arange(10.0)[:, None], np.arange(10)
    loader = data.ArrayLoader(X, y, 4, shuffle=True, seed=1, drop_last=drop_last)
    batches = list(loader)
    assert [len(b[1]) for b in batches] == lengths == [len(b[0]) for b in batches]
    assert len(loader) == len(lengths)
    seen = np.concatenate([b[1] for b in batches])
    assert len(set(seen)) == len(seen)
    if not drop_last:
        assert sorted(seen) == list(range(10))
    for Xb, yb in batches:
        np.testing.assert_array_equal(Xb[:, 0], yb)
    assert not np.array_equal(seen, np.concatenate([b[1] for b in loader]))  # reshuffled


def test_real_fashion_mnist(fashion_mnist_dir):
    X_train, y_train, X_test, y_test = data.read_fashion_mnist(fashion_mnist_dir, [DEAD_MIRROR])
    assert X_train.shape == (60000, 28, 28) and X_test.shape == (10000, 28, 28)
    assert X_train.dtype == y_train.dtype == np.uint8
    assert np.bincount(y_train).tolist() == [6000] * 10
    assert np.bincount(y_test).tolist() == [1000] * 10
    assert data.get_fashion_mnist_labels(y_train[:2]) == [data.TEXT_LABELS[y_train[0]],
                                                          data.TEXT_LABELS[y_train[1]]]
    pixels = X_train.astype(np.float64) / 255          # the statistics loaders standardize with
    assert abs(pixels.mean() - data.FASHION_MNIST_MEAN) < 1e-4
    assert abs(pixels.std() - data.FASHION_MNIST_STD) < 1e-4
