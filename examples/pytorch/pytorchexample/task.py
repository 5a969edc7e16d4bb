"""pytorchexample: A Flower / PyTorch app."""
from __future__ import annotations

import io
from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from flwr.app import ArrayRecord
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """A small CNN for 8x8 grey-scale digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (no download), scaled to [0, 1]; a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = data.target.astype(np.int64)
    order = np.random.default_rng(42).permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = order[:cut], order[cut:]
    return x[tr], y[tr], x[te], y[te]


def load_data(partition_id: int, num_partitions: int, batch_size: int = 32) -> tuple[DataLoader, DataLoader]:
    """This partition's share of the training digits (IID), 80/20 into train and validation."""
    x, y, _, _ = _digits()
    part = np.array_split(np.arange(len(y)), num_partitions)[partition_id]
    cut = int(0.8 * len(part))
    tr, va = part[:cut], part[cut:]
    g = torch.Generator().manual_seed(partition_id)
    trainloader = DataLoader(TensorDataset(torch.from_numpy(x[tr]), torch.from_numpy(y[tr])), batch_size=batch_size,
                             shuffle=True, generator=g)
    valloader = DataLoader(TensorDataset(torch.from_numpy(x[va]), torch.from_numpy(y[va])), batch_size=batch_size)
    return trainloader, valloader


def load_centralized_dataset() -> DataLoader:
    """The held-out test digits, for the ServerApp's central evaluation."""
    _, _, x, y = _digits()
    return DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=128)


def train(net: Net, trainloader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    """Train the model on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net: Net, testloader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Validate the model on the test set."""
    net.to(device)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    return loss / len(testloader), accuracy


def to_onnx(arrays: ArrayRecord) -> bytes:
    """Fogline export hook: the global ArrayRecord -> ONNX (what the fleet serves, batch of 1)."""
    net = Net()
    net.load_state_dict(arrays.to_torch_state_dict())
    net.eval()
    buf = io.BytesIO()
    torch.onnx.export(net, (torch.zeros(1, 1, 8, 8),), buf, input_names=["x"], output_names=["logits"],
                      dynamo=False)
    return buf.getvalue()
