"""Fashion-MNIST: find, download, verify and read it; framework-free.

The four official files are looked for in the cache folder, which is ``root`` if given,
else ``$DPBOOK_DATA``, else a per-user cache folder (``platformdirs``). A missing file, or
one whose SHA-256 does not match (corrupted, truncated), is downloaded again by ``pooch``
from the official URL or one of its mirrors; ``pooch`` writes to a temporary file and
renames it, so an interrupted download never leaves a half file under the real name.
Nothing happens at import time.

    X_train, y_train, X_test, y_test = read_fashion_mnist()   # uint8 arrays
"""
from __future__ import annotations

import gzip
import os
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

__all__ = ["FILES", "MIRRORS", "FASHION_MNIST_MEAN", "FASHION_MNIST_STD", "TEXT_LABELS",
           "DataUnavailableError", "data_dir", "fetch_fashion_mnist", "read_fashion_mnist",
           "subset", "pixels", "ArrayLoader", "get_fashion_mnist_labels"]

#: The official files and their SHA-256 sums (the sums Keras checks).
FILES = {
    "train-images-idx3-ubyte.gz": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
    "train-labels-idx1-ubyte.gz": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
    "t10k-images-idx3-ubyte.gz": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
    "t10k-labels-idx1-ubyte.gz": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
}

#: Where the same bytes are published, tried in this order.
MIRRORS = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://storage.googleapis.com/tensorflow/tf-keras-datasets/",
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
)

#: Mean and standard deviation of the training images' pixels, scaled to [0, 1] (all
#: 60,000 images; tests/test_data.py recomputes them). Loaders standardize with these
#: when asked (``normalize=True``).
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530

TEXT_LABELS = ("t-shirt", "trouser", "pullover", "dress", "coat",
               "sandal", "shirt", "sneaker", "bag", "ankle boot")


class DataUnavailableError(RuntimeError):
    """No valid copy of a dataset file could be found or downloaded."""


def data_dir(root: str | os.PathLike | None = None) -> Path:
    """The dataset folder: ``root``, else ``$DPBOOK_DATA``, else the per-user cache."""
    if root is None:
        root = os.environ.get("DPBOOK_DATA") or None
    if root is None:
        import platformdirs
        root = Path(platformdirs.user_cache_dir("dpbook")) / "fashion-mnist"
    return Path(root).expanduser().resolve()


def fetch_fashion_mnist(root: str | os.PathLike | None = None,
                        mirrors: Sequence[str] = MIRRORS) -> dict[str, Path]:
    """Make sure the four files are in :func:`data_dir` with the right hashes.

    Returns ``{file name: path}``. Raises :class:`DataUnavailableError` naming every file
    that could not be obtained, the URLs tried and ``DPBOOK_DATA``.
    """
    with warnings.catch_warnings():   # pooch imports tqdm.auto, which warns in Jupyter
        warnings.filterwarnings("ignore", message="IProgress not found")
        import pooch

    folder = data_dir(root)
    found, failures = {}, {}
    for name, sha256 in FILES.items():
        path = folder / name
        if path.is_file() and pooch.file_hash(str(path)) == sha256:
            found[name] = path      # the common case: no download, no write
            continue
        errors = []
        if path.is_file():
            errors.append(f"{path}: present, but its SHA-256 does not match "
                          "(corrupt or truncated); not used")
        for base in mirrors:
            url = base + name
            progress = _progressbar(name)
            try:
                found[name] = Path(pooch.retrieve(
                    url, known_hash=f"sha256:{sha256}", fname=name, path=folder,
                    progressbar=progress))
                break
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                errors.append(f"{url}: {type(e).__name__}: {_first_line(e)}")
            finally:
                if progress:
                    progress.close()
        else:
            failures[name] = errors
    if failures:
        lines = [f"Fashion-MNIST is not available: {len(failures)} file(s) missing or corrupt "
                 f"in {folder} and no mirror could provide a valid copy."]
        for name, errors in failures.items():
            lines.append(f"  {name} (sha256 {FILES[name][:12]}...):")
            lines += [f"    {e}" for e in errors]
        lines.append("Copy the official files into that folder, or set DPBOOK_DATA to a "
                     "folder that has them (e.g. DPBOOK_DATA=../shared/fashion-mnist).")
        raise DataUnavailableError("\n".join(lines))
    return found


def _progressbar(name: str):
    """A plain-text tqdm bar for pooch (``tqdm.auto`` would need ipywidgets in Jupyter)."""
    try:
        from tqdm.std import tqdm
    except ImportError:
        return False
    return tqdm(desc=name, unit="B", unit_scale=True, leave=False, total=0)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""


def _read_idx(path: Path) -> np.ndarray:
    """Read one gzipped IDX file (the MNIST format) into a uint8 array."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    if data[:3] != b"\x00\x00\x08" or ndim not in (1, 3):
        raise DataUnavailableError(f"{path} is not an IDX file of unsigned bytes")
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    return array.reshape(shape)


def read_fashion_mnist(root: str | os.PathLike | None = None, mirrors: Sequence[str] = MIRRORS
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``X_train (60000, 28, 28), y_train (60000,), X_test (10000, 28, 28), y_test``.

    All four are ``uint8`` numpy arrays; files are fetched first if needed.
    """
    paths = fetch_fashion_mnist(root, mirrors)
    return tuple(_read_idx(paths[name]) for name in FILES)  # type: ignore[return-value]


def pixels(X: np.ndarray, normalize: bool = False) -> np.ndarray:
    """uint8 images → float32 in [0, 1], or standardized with the training set's pixel mean
    and standard deviation (``FASHION_MNIST_MEAN``, ``FASHION_MNIST_STD``) when
    ``normalize``. The PyTorch and JAX loaders both use it; they only add a channel axis."""
    X = X.astype(np.float32) / 255
    if normalize:
        X = (X - np.float32(FASHION_MNIST_MEAN)) / np.float32(FASHION_MNIST_STD)
    return X


def subset(X: np.ndarray, y: np.ndarray, n: int | None, seed: int = 0
           ) -> tuple[np.ndarray, np.ndarray]:
    """The same ``n`` examples every time (a fixed random choice, in dataset order).

    ``n=None`` (or ``n >= len(X)``) returns the arrays unchanged.
    """
    if n is None or n >= len(X):
        return X, y
    if n < 1:
        raise ValueError(f"subset size must be positive, got {n}")
    idx = np.sort(np.random.default_rng(seed).permutation(len(X))[:n])
    return X[idx], y[idx]


def get_fashion_mnist_labels(labels) -> list[str]:
    """Text labels for numeric ones."""
    return [TEXT_LABELS[int(i)] for i in labels]


class ArrayLoader:
    """Minibatches of numpy arrays, reshuffled every epoch (for JAX and for plain numpy).

    ``drop_last=True`` keeps every batch the same shape, which jitted code wants.
    """

    def __init__(self, X: np.ndarray, y: np.ndarray, batch_size: int, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False):
        if len(X) != len(y):
            raise ValueError(f"X has {len(X)} examples and y has {len(y)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.X, self.y = X, y
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self._rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        n, b = len(self.X), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        n = len(self.X)
        order = self._rng.permutation(n) if self.shuffle else np.arange(n)
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.X[idx], self.y[idx]
