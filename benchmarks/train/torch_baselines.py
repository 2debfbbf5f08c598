"""The PyTorch baselines: the same model, batches and initial weights trained by plain
PyTorch (an `EmbeddingBag(sparse=True)` a table, `SparseAdam`) and by TorchRec's
`FusedEmbeddingBagCollection` on FBGEMM's CPU kernels, whose fused optimizer is row-wise
Adagrad (FBGEMM's CPU tables have no Adam), each round in its own process (`--role
torch`), where no TensorFlow step ran. Optional: they need the `torch-baselines` extra
and torchrec (`INSTALL`); `missing` says why one cannot run."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.train.lazy_adam import BETA_1, BETA_2, EPSILON
from benchmarks.train.local import (
    DENSE_LR,
    EMBEDDING_LR,
    VOCABULARY,
    initial_tables,
)
from benchmarks.train.processes import method_role
from benchmarks.train.steps import LocalRound, run_in_process, stacked_columns
from trainer.data import Batch

TORCH_METHODS = ("torchrec", "torch_sparse_adam")
INSTALL = "pip install -e '.[torch-baselines]' && pip install --no-deps 'torchrec>=1.9,<1.10'"
# torch._dynamo, which torch.optim's step imports, loads triton: it must come before
# TensorFlow (see `skipped`)
_NEEDS = {
    "torch_sparse_adam": ("torch", "torch._dynamo"),
    "torchrec": ("torch", "torch._dynamo", "fbgemm_gpu", "torchrec"),
}
THREADS = 2  # the machine's cores, as the other methods get them
# TorchRec's fused row-wise Adagrad: the demo tables' learning rate, FBGEMM's other defaults
ROWWISE_ADAGRAD = {"lr": EMBEDDING_LR}


def missing(method: str) -> str | None:
    """Why `method` cannot run in this interpreter (a module it needs does not import, with
    the command that installs it), or None."""
    for name in _NEEDS[method]:
        try:
            importlib.import_module(name)
        # not only ImportError: a native library that does not load raises OSError
        except Exception as exc:
            return f"{name} does not import ({type(exc).__name__}: {exc}); install with: {INSTALL}"
    return None


def skipped(mode: str) -> dict[str, str]:
    """The methods of TORCH_METHODS that do not run under `--torch mode` (auto, on, off),
    each with why. Call it before TensorFlow is imported: it imports what the methods need,
    triton among them (through torch._dynamo and torchrec), and triton crashes the process
    (SIGSEGV) when TensorFlow's libraries were loaded first."""
    if mode == "off":
        return {m: "--torch off" for m in TORCH_METHODS}
    return {m: why for m in TORCH_METHODS if (why := missing(m)) is not None}


def grouped(reasons: Mapping[str, str]) -> list[str]:
    """One line a reason: "torchrec, torch_sparse_adam: <why>"."""
    by: dict[str, list[str]] = {}
    for method, why in reasons.items():
        by.setdefault(why, []).append(method)
    return [f"{', '.join(methods)}: {why}" for why, methods in by.items()]


def _check_import_order(method: str) -> None:
    """A clear error instead of the crash `skipped` describes."""
    if "tensorflow" in sys.modules and any(n not in sys.modules for n in _NEEDS[method]):
        raise RuntimeError(
            f"{method}: {', '.join(_NEEDS[method])} must be imported before tensorflow (the "
            "triton they load crashes the process otherwise): call torch_baselines.missing() "
            "first"
        )


def _mlp(dense: Sequence[np.ndarray]) -> Any:
    """The MLP with Keras' initial weights: a kernel (in, out) becomes a Linear's (out, in)."""
    import torch

    if len(dense) % 2:
        raise ValueError(f"dense weights come as (kernel, bias) pairs, got {len(dense)} arrays")
    layers: list[Any] = []
    for kernel, bias in zip(dense[::2], dense[1::2], strict=True):
        linear = torch.nn.Linear(*kernel.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(kernel.T)))
            linear.bias.copy_(torch.from_numpy(bias))
        layers += [linear, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])  # the last layer's logit, no ReLU


def _run(method: str, r: LocalRound, embed: Any, sparse_step: Any) -> dict[str, Any]:
    """Train `embed` ((batch, tables) ids -> (batch, tables * dim)) and the MLP; the tables'
    optimizer runs in `sparse_step` (None: fused into the backward pass)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(THREADS)
    torch.manual_seed(r.seed)
    mlp = _mlp(r.initial_dense)
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=DENSE_LR, betas=(BETA_1, BETA_2), eps=EPSILON)
    columns = list(r.schema.categorical)
    numeric = list(r.schema.numeric)

    def logits(inputs: tuple[Any, Any]) -> Any:
        ids, values = inputs
        return mlp(torch.cat([embed(ids), values], dim=1)).reshape(-1)

    def step(inputs: tuple[Any, Any], labels: Any) -> Any:
        dense_opt.zero_grad(set_to_none=True)
        if sparse_step is not None:
            sparse_step.zero_grad(set_to_none=True)
        loss: Any = F.binary_cross_entropy_with_logits(logits(inputs), labels)
        loss.backward()
        if sparse_step is not None:
            sparse_step.step()
        dense_opt.step()
        return loss.detach()

    def predict(inputs: tuple[Any, Any]) -> Any:
        with torch.no_grad():
            return torch.sigmoid(logits(inputs))

    def tensors(batch: Batch) -> tuple[Any, Any]:
        ids, numbers = stacked_columns(batch, columns, numeric)
        return torch.from_numpy(ids % VOCABULARY), torch.from_numpy(numbers)

    def labels(values: np.ndarray) -> Any:
        return torch.from_numpy(np.asarray(values, dtype=np.float32))

    return run_in_process(method, step, predict, tensors, r, labels=labels)


def run_torch_sparse_adam(r: LocalRound) -> dict[str, Any]:
    """Plain PyTorch: an `EmbeddingBag(sparse=True)` a table (one id a bag), `SparseAdam`
    on them (one step count a table, not one a row: its bias correction differs from the
    service's), Adam on the MLP. One bag a table: SparseAdam's step costs more the more rows
    its parameter has, so one bag stacking the 26 tables trains slower."""
    _check_import_order("torch_sparse_adam")
    import torch

    tables = initial_tables(r)
    bags = torch.nn.ModuleList()
    for t in tables:
        bag = torch.nn.EmbeddingBag(t.shape[0], t.shape[1], mode="sum", sparse=True)
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(t))
        bags.append(bag)
    opt = torch.optim.SparseAdam(
        bags.parameters(), lr=EMBEDDING_LR, betas=(BETA_1, BETA_2), eps=EPSILON
    )

    def embed(ids: Any) -> Any:
        return torch.cat([bag(ids[:, k : k + 1]) for k, bag in enumerate(bags)], dim=1)

    return _run("torch_sparse_adam", r, embed, opt)


def run_torchrec(r: LocalRound) -> dict[str, Any]:
    """TorchRec: a `FusedEmbeddingBagCollection` of the 26 tables (one FBGEMM table-batched
    embedding on the CPU, sum pooling of one id a bag) whose row-wise Adagrad runs in the
    backward pass; Adam on the MLP. Each batch goes in as a `KeyedJaggedTensor`."""
    _check_import_order("torchrec")
    import torch
    import torchrec.optim as trec_optim
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    columns = list(r.schema.categorical)
    tables = initial_tables(r)
    configs = [
        EmbeddingBagConfig(
            name=c,
            embedding_dim=int(t.shape[1]),
            num_embeddings=VOCABULARY,
            feature_names=[c],
            pooling=PoolingType.SUM,
        )
        for c, t in zip(columns, tables, strict=True)
    ]
    ebc = FusedEmbeddingBagCollection(
        tables=configs,
        optimizer_type=trec_optim.RowWiseAdagrad,
        optimizer_kwargs=dict(ROWWISE_ADAGRAD),
        device=torch.device("cpu"),
    )
    state = ebc.state_dict()
    with torch.no_grad():
        for c, t in zip(columns, tables, strict=True):
            state[f"embedding_bags.{c}.weight"].copy_(torch.from_numpy(t))

    def embed(ids: Any) -> Any:
        # key-major values: every id of table 1, then of table 2, ...; one id a bag
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=columns,
            values=ids.t().reshape(-1),
            lengths=torch.ones(ids.numel(), dtype=torch.int64),
        )
        return ebc(features).values()

    return _run("torchrec", r, embed, None)


def torch_role(args: argparse.Namespace) -> int:
    """A PyTorch baseline's round in this process (`--role torch`): its packages imported
    before TensorFlow (which draws the initial rows), then `run_torchrec` or
    `run_torch_sparse_adam`."""
    if (why := missing(args.method)) is not None:
        raise RuntimeError(f"{args.method}: {why}")
    run = {"torchrec": run_torchrec, "torch_sparse_adam": run_torch_sparse_adam}[args.method]
    return method_role(args, run)
