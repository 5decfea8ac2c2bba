"""Image data for image classifiers (the article's CIFAR-10 example) and torchvision models.

Without --data: a synthetic CIFAR-10-shaped dataset (3x32x32 images, 10 classes, 50,000 training
and 10,000 validation samples), each image a pure function of its index, with a class-dependent
mean so that there is something to learn. With --data DIR: the real CIFAR-10 from its python
version (`cifar-10-batches-py`: data_batch_1..5 and test_batch), read without torchvision.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from gptlite.data import DataError
from gptlite.errors import ConfigError
from models.sampling import SampledDataset

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


def _read_batches(directory: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for name in names:
        path = directory / name
        try:
            with open(path, "rb") as f:
                batch = pickle.load(f, encoding="bytes")
            images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, *SHAPE))
            labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
        except FileNotFoundError:
            raise DataError(f"--data: {path} not found (CIFAR-10's python version: data_batch_1..5, test_batch)") \
                from None
        except (pickle.UnpicklingError, KeyError, ValueError, EOFError) as e:
            raise DataError(f"--data: {path} is not a CIFAR-10 batch ({type(e).__name__})") from None
    return np.concatenate(images), np.concatenate(labels)


def image_data(data: str | None) -> SampledDataset:
    """Synthetic CIFAR-10-shaped data, or CIFAR-10 from the directory `data`."""
    if data is None:
        return SampledDataset(SyntheticImages(50_000), SyntheticImages(10_000, offset=50_000),
                              "synthetic CIFAR-10-shaped images (3x32x32, 10 classes)")
    root = Path(data)
    if not root.is_dir():
        raise DataError(f"--data: an image model reads CIFAR-10 from a directory (cifar-10-batches-py); "
                        f"{data} is not a directory")
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    train = ArrayImages(*_read_batches(root, [f"data_batch_{i}" for i in range(1, 6)]))
    val = ArrayImages(*_read_batches(root, ["test_batch"]))
    return SampledDataset(train, val, f"CIFAR-10 ({root.resolve()})")


def load_torchvision(request):
    """torchvision.models.get_model(<name>, num_classes=10, **model_args) on CIFAR-10-shaped data."""
    from models.workload import Workload, WithLoss

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
    data = image_data(request.data)
    return Workload(request.name, {"name": request.name, "args": args}, data,
                    lambda: WithLoss(torchvision.models.get_model(name, **args)))
