"""A tiny Hugging Face DDP job on CPU (gloo): ``transformers.Trainer`` or an accelerate loop.

The model is a two-layer BERT built from a config (nothing is downloaded).
``--same-batches`` reproduces the real mistake: every rank iterates the whole
dataset in one order (the loader built after ``accelerator.prepare``, or handed
over with ``split_batches`` semantics lost), so all ranks train on the same batches.

Under ``--api accelerate``, ``--dispatch`` has rank 0 iterate the loader and
scatter slices of each batch (``DataLoaderConfiguration(dispatch_batches=True)``);
``--iterable`` trains from an ``IterableDataset`` (accelerate dispatches those by
default; with ``--no-dispatch`` each rank keeps its own batches of the stream,
``IterableDatasetShard``). ``--iterable --same-batches`` is the iterable mistake:
the loader is not prepared, so every rank reads the whole stream; ``--iterable
--workers 2`` the worker one: each DataLoader worker yields the whole stream
(``--worker-split``: each keeps its own part).
``--group-by-length`` has the Trainer group samples of similar length
(``train_sampling_strategy="group_by_length"``) over sequences of 4-16 tokens,
padded per batch: its LengthGroupedSampler draws from the global RNG, which
the ranks' dropout over batches of different lengths moves apart, so from the
second epoch their orders differ and accelerate's batch sharding overlaps them
(transformers 5.23); ``--seeded-sampler`` gives it a seeded generator, the fix.
``--uneven-batches`` is ``even_batches=False`` on a dataset whose batches do not
split evenly: one rank trains a batch the others never run, and the job hangs
until the 15 s collective timeout.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Tokens(Dataset):
    """Random token sequences with a label that depends on them (learnable)."""

    def __init__(self, n: int, seq: int = 16, vocab: int = 128, varlen: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)
        self.labels = (self.ids[:, 0] > vocab // 2).long()
        #: ``varlen``: sample i keeps its first lens[i] tokens (4 to ``seq``).
        self.lens = torch.randint(4, seq + 1, (n,), generator=g) if varlen else None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i] if self.lens is None else self.ids[i, : int(self.lens[i])]
        return {"input_ids": ids, "labels": self.labels[i]}


class TokenStream(IterableDataset):
    """The same samples as :class:`Tokens`, read as a stream (no indices, no sampler).

    ``by_worker``: each DataLoader worker keeps its own part (every
    ``num_workers``-th sample); else every worker yields the whole stream.
    """

    def __init__(self, n: int, by_worker: bool = False) -> None:
        self.data = Tokens(n)
        self.by_worker = by_worker

    def __iter__(self) -> Any:
        from torch.utils.data import get_worker_info

        info = get_worker_info() if self.by_worker else None
        start, every = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, len(self.data), every):
            yield self.data[i]


class SlowCollate:
    """Collation that stalls on one rank: a data-loading straggler."""

    def __init__(self, slow_rank: int, slow_ms: float) -> None:
        self.slow_rank, self.slow_ms = slow_rank, slow_ms

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if self.slow_ms and rank() == self.slow_rank:
            time.sleep(self.slow_ms / 1000)
        longest = max(len(it["input_ids"]) for it in items)
        if any(len(it["input_ids"]) != longest for it in items):
            ids = torch.zeros(len(items), longest, dtype=torch.long)
            for k, it in enumerate(items):
                ids[k, : len(it["input_ids"])] = it["input_ids"]
            labels = torch.stack([it["labels"] for it in items])
            return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def model() -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    return BertForSequenceClassification(cfg)


def trainer(args: argparse.Namespace) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class SlowCallback(TrainerCallback):
        """Takes its time on one rank after each optimizer step, as a rank-0 logger
        does: a straggler outside data loading."""

        def on_step_end(self, *_: Any, **__: Any) -> None:
            if args.slow_ms and rank() == args.slow_rank:
                time.sleep(args.slow_ms / 1000)

    callbacks: list[Any] = [SlowCallback()] if args.slow_in == "callback" else []
    if args.callback:
        from ddpscope.hf import DDPScopeCallback

        callbacks.append(DDPScopeCallback())
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.batch,
            num_train_epochs=args.epochs,
            learning_rate=1e-3,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            ddp_backend="gloo",
            gradient_accumulation_steps=args.accum,
            seed=0,
            train_sampling_strategy="group_by_length" if args.group_by_length else "random",
        )

        class SeededTrainer(Trainer):
            """The fix for --group-by-length: the sampler draws from its own generator."""

            def _get_train_sampler(self, *a: Any, **kw: Any) -> Any:
                sampler = super()._get_train_sampler(*a, **kw)
                if args.seeded_sampler:
                    sampler.generator = torch.Generator().manual_seed(0)  # type: ignore[union-attr]
                return sampler

        t = SeededTrainer(
            model=model(),
            args=targs,
            train_dataset=Tokens(args.samples, varlen=args.group_by_length),
            data_collator=SlowCollate(
                args.slow_rank, args.slow_ms if args.slow_in == "collate" else 0
            ),
            callbacks=callbacks,
        )
        t.train()
        if t.is_world_process_zero():
            print(f"done: {t.state.global_step} optimizer steps", flush=True)


def accelerate_loop(args: argparse.Namespace) -> None:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import GradientAccumulationPlugin

    # None: accelerate's default (dispatch an IterableDataset, shard the rest).
    dispatch = True if args.dispatch else False if args.no_dispatch else None
    kwargs: list[Any] = []
    if args.uneven_batches:
        from datetime import timedelta

        from accelerate import InitProcessGroupKwargs

        # The uneven job hangs: end it by the collective timeout.
        kwargs.append(InitProcessGroupKwargs(timeout=timedelta(seconds=15)))
    acc = Accelerator(
        cpu=True,
        kwargs_handlers=kwargs,
        dataloader_config=DataLoaderConfiguration(
            dispatch_batches=dispatch, even_batches=not args.uneven_batches
        ),
        # sync_each_batch: accelerate all-reduces every micro-batch (meant to save memory
        # under FSDP; under DDP it only adds all-reduces).
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.accum, sync_each_batch=args.sync_each_batch
        ),
    )
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    collate = SlowCollate(args.slow_rank, args.slow_ms)
    if args.iterable:
        loader = DataLoader(
            TokenStream(args.samples, by_worker=args.worker_split),
            batch_size=args.batch,
            collate_fn=collate,
            num_workers=args.workers,
        )
    elif args.distributed_sampler:
        # The bug: a rank's DistributedSampler shard, which prepare() shards again.
        data = Tokens(args.samples)
        sampler = DistributedSampler(data, acc.num_processes, acc.process_index, shuffle=True)
        loader = DataLoader(data, batch_size=args.batch, sampler=sampler, collate_fn=collate)
    else:
        loader = DataLoader(
            Tokens(args.samples), batch_size=args.batch, shuffle=True, collate_fn=collate
        )
    if args.same_batches:
        # The bug: only model and optimizer go through prepare(); the loader
        # is the plain one, so every rank iterates the whole dataset.
        net, opt = acc.prepare(net, opt)
    else:
        net, opt, loader = acc.prepare(net, opt, loader)
    steps = 0
    for _epoch in range(args.epochs):
        for batch in loader:
            with acc.accumulate(net):
                out = net(**batch)
                acc.backward(out.loss)
                # Under accumulate(), accelerate's optimizer wrapper steps only at
                # the end of each cycle.
                opt.step()
                opt.zero_grad()
            steps += int(acc.sync_gradients)
    acc.wait_for_everyone()
    if acc.is_main_process:
        print(f"done: {steps} optimizer steps", flush=True)
    acc.end_training()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--api", choices=["trainer", "accelerate"], default="trainer")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-ms", type=float, default=0)
    p.add_argument(
        "--slow-in", choices=["collate", "callback"], default="collate", help="trainer: where"
    )
    p.add_argument("--same-batches", action="store_true")
    p.add_argument(
        "--distributed-sampler",
        action="store_true",
        help="accelerate: the loader already shards by rank (prepare() shards it again)",
    )
    p.add_argument("--dispatch", action="store_true", help="accelerate: rank 0 scatters")
    p.add_argument("--no-dispatch", action="store_true", help="accelerate: never dispatch")
    p.add_argument("--iterable", action="store_true", help="accelerate: an IterableDataset")
    p.add_argument("--workers", type=int, default=0, help="accelerate --iterable: workers")
    p.add_argument("--worker-split", action="store_true", help="the stream splits by worker")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--sync-each-batch", action="store_true", help="accelerate: sync each one")
    p.add_argument("--callback", action="store_true", help="attach with ddpscope's callback")
    p.add_argument("--group-by-length", action="store_true", help="trainer: length grouping")
    p.add_argument("--seeded-sampler", action="store_true", help="--group-by-length: seeded")
    p.add_argument(
        "--uneven-batches",
        action="store_true",
        help="accelerate: even_batches=False, so ranks get different numbers of batches",
    )
    args = p.parse_args()
    if args.api == "trainer":
        trainer(args)
    else:
        accelerate_loop(args)


if __name__ == "__main__":
    main()
