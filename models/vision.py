"""Image data for image classifiers (the article's CIFAR-10 example) and torchvision models.

Without --data: a synthetic CIFAR-10-shaped dataset (3x32x32 images, 10 classes, 50,000 training
and 10,000 validation samples), each image a pure function of its index, with a class-dependent
mean so that there is something to learn. With --data DIR: the real CIFAR-10, read without
torchvision, from its binary version (`cifar-10-batches-bin`: data_batch_1..5.bin and test_batch.bin,
plain bytes) or, with --trust_data, its python version (`cifar-10-batches-py`: pickles, which can run
code when read, so they are read accepting only what CIFAR-10's batches hold: arrays, lists, bytes).
"""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path

import numpy as np
import torch

from gptlite.data import DataError
from gptlite.errors import ConfigError
from models.sampling import SampledDataset
from models.workload import Workload, WithLoss

CLASSES, SHAPE = 10, (3, 32, 32)
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class SyntheticImages(torch.utils.data.Dataset):
    """`n` images of SHAPE, sample i from its own generator: the same on every rank and run."""

    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset = n, offset
        self.means = torch.randn(CLASSES, SHAPE[0], 1, 1, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        index = self.offset + int(i)
        label = index % CLASSES
        noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(index))
        return self.means[label] + noise, label


class ArrayImages(torch.utils.data.Dataset):
    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = torch.from_numpy(self.images[int(i)]).float().div_(255)
        return (image - self.mean) / self.std, int(self.labels[int(i)])


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that builds only what CIFAR-10's python batches hold (dicts, lists, bytes, numbers
    and numpy arrays): any other global a pickle names is refused before it is called (the pickle
    module's own "Restricting Globals" recipe), so reading one runs no code of its author's."""

    _RECONSTRUCT = np.ndarray(0).__reduce__()[0]  # numpy's own array reconstructor, wherever numpy keeps it
    # Python 3 writes bytes in protocol 2 (CIFAR-10's own) as _codecs.encode(text, "latin1"): data, no code.
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
               ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
               ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype, ("_codecs", "encode"): codecs.encode}

    def find_class(self, module, name):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch does not hold") from None


def _read_pickled(directory: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for name in names:
        path = directory / name
        try:
            with open(path, "rb") as f:
                batch = _ArraysOnly(f, encoding="bytes").load()
            images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, *SHAPE))
            labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
        except FileNotFoundError:
            raise DataError(f"--data: {path} not found (CIFAR-10's python version: data_batch_1..5, test_batch)") \
                from None
        except pickle.UnpicklingError as e:
            raise DataError(f"--data: {path} is not a CIFAR-10 batch ({e})") from None
        except (KeyError, ValueError, TypeError, EOFError, IndexError) as e:
            raise DataError(f"--data: {path} is not a CIFAR-10 batch ({type(e).__name__})") from None
    return np.concatenate(images), np.concatenate(labels)


BINARY_RECORD = 1 + SHAPE[0] * SHAPE[1] * SHAPE[2]  # the binary version: a label byte, then the image's bytes


def _read_binary(directory: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for name in names:
        path = directory / f"{name}.bin"
        try:
            raw = np.fromfile(path, dtype=np.uint8)
        except FileNotFoundError:
            raise DataError(f"--data: {path} not found (CIFAR-10's binary version: data_batch_1..5.bin, "
                            "test_batch.bin)") from None
        if raw.size == 0 or raw.size % BINARY_RECORD:
            raise DataError(f"--data: {path} is not a CIFAR-10 binary batch ({raw.size} bytes, not a multiple of "
                            f"{BINARY_RECORD})")
        records = raw.reshape(-1, BINARY_RECORD)
        if records[:, 0].max() >= CLASSES:
            raise DataError(f"--data: {path} is not a CIFAR-10 binary batch (a label of {records[:, 0].max()}; "
                            f"CIFAR-10 has {CLASSES} classes)")
        labels.append(records[:, 0].astype(np.int64))
        images.append(np.ascontiguousarray(records[:, 1:]).reshape(-1, *SHAPE))
    return np.concatenate(images), np.concatenate(labels)


def image_data(data: str | None, trust: bool = False) -> SampledDataset:
    """Synthetic CIFAR-10-shaped data, or CIFAR-10 from the directory `data` (its python version's
    pickles only with `trust`, --trust_data)."""
    if data is None:
        return SampledDataset(SyntheticImages(50_000), SyntheticImages(10_000, offset=50_000),
                              "synthetic CIFAR-10-shaped images (3x32x32, 10 classes)")
    root = Path(data)
    if not root.is_dir():
        raise DataError(f"--data: an image model reads CIFAR-10 from a directory (cifar-10-batches-bin or "
                        f"cifar-10-batches-py); {data} is not a directory")
    for version in ("cifar-10-batches-bin", "cifar-10-batches-py"):
        if (root / version).is_dir():
            root = root / version
            break
    names = [f"data_batch_{i}" for i in range(1, 6)]
    if (root / "data_batch_1.bin").is_file():
        read = _read_binary
    elif not (root / "data_batch_1").is_file():
        raise DataError(f"--data: {root} holds no CIFAR-10 batches (the binary version's data_batch_1..5.bin and "
                        "test_batch.bin, or the python version's data_batch_1..5 and test_batch)")
    elif not trust:
        raise DataError(f"--data: {root} is CIFAR-10's python version, whose batches are pickles (reading a pickle "
                        "can run code its author put in it); pass --trust_data to read them (arrays, lists and bytes "
                        "only), or use CIFAR-10's binary version (cifar-10-batches-bin)")
    else:
        read = _read_pickled
    train = ArrayImages(*read(root, names))
    val = ArrayImages(*read(root, ["test_batch"]))
    return SampledDataset(train, val, f"CIFAR-10 ({root.resolve()})")


def load_torchvision(request):
    """torchvision.models.get_model(<name>, num_classes=10, **model_args) on CIFAR-10-shaped data."""
    name = request.name.split(":", 1)[1]
    try:
        import torchvision
    except Exception as e:  # noqa: BLE001 - e.g. "operator torchvision::nms does not exist"
        raise ConfigError(f"model {request.name}: torchvision does not import here ({type(e).__name__}: {e}); "
                          "PyPI's torchvision wheels are built against CUDA torch, and no CPU build matches the "
                          "pinned CPU torch. Install the torchvision that matches your torch, or use "
                          "--model hf:resnet") from None
    if name not in torchvision.models.list_models():
        raise ConfigError(f"model {request.name}: torchvision has no model {name!r}")
    if request.dropout is not None:
        raise ConfigError("dropout applies to gptlite and hf: models; set a torchvision model's in --model_args")
    args = {"num_classes": CLASSES, **request.args}
    data = image_data(request.data, request.trust_data)
    return Workload(request.name, {"name": request.name, "args": args}, data,
                    lambda: WithLoss(torchvision.models.get_model(name, **args)))
