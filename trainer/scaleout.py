"""Scale-out of the near-line trainer's step: Ray Train's TorchTrainer with DistributedDataParallel.

With `NearlineConfig.workers > 1` the NearlineTrainer stays the one owner of the store, the replay
buffer, the held-out pools, checkpoints, acks and candidates (the coordinator), and its optimizer step
runs on a Ray Train worker group instead of in-process:
- each step's rows are split into one shard a worker; every worker builds its own batch from its rows
  with its own copy of the target (regenerating features where a record has none: the costly part
  scales out too) and runs `trainer.step.train_step` through DDP, which averages the gradients over
  the workers (gloo on CPU, NCCL on GPU) before clipping and the AdamW update, so every worker holds
  the same head after every step;
- rank 0 answers for the weights and the optimizer state (the coordinator pulls them before a
  checkpoint or a candidate) and every rank reports its step statistics;
- the coordinator pushes a head (and optimizer state) whenever it starts from a new one: a champion
  change, a resume, a cold start.
A step is all-or-nothing: a worker that fails ends the run, the coordinator's step raises, and the
trainer actor restarts from its last checkpoint (records are acked only after a checkpoint), as it does
in-process. A batch with fewer rows than workers gives the spare workers copies of rows: the average of
identical gradients is that gradient, so one row trains as it would in-process.

Sequence parallel (`split="positions"`, NearlineConfig.sequence_parallel): for records whose training does not
fit one worker, every worker gets all of a step's rows and trains its contiguous position shard of every row
(`trainer.seqpar.sequence_parallel_step`: the step-0 keys and values pass round a ring over the same process
group, gloo or NCCL, and the workers' gradients are summed, not averaged: each holds a share of one batch's
loss). No DDP wrapper; the same load/step/state protocol, and every worker reports the whole batch's statistics.

Owns: the worker loop, the message protocol (per-rank inbox queues, one outbox), shard assignment,
merging the workers' statistics. Must not touch: the store (ingest.py), checkpoints (checkpointing.py),
candidates (candidates.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from adaptive_eagle.draft_head import Eagle3DraftHead
from trainer.state import head_from_weights, head_weights
from trainer.seqpar import sequence_parallel_step
from trainer.step import StepConfig, StepStats, adamw, set_lr, train_step
from trainer.traffic import TrafficRow, make_traffic_batch
from trainer.ttt import TTTBatch, ttt_loss

log = logging.getLogger(__name__)

SPLITS = ("rows", "positions")  # data parallel (whole rows a worker), sequence parallel (a position shard of every row)

REPLY_TIMEOUT_S = 600.0  # a step on a loaded worker group; beyond this the coordinator gives up (and restarts)


class ScaleOutError(RuntimeError):
    """The worker group failed or stopped answering; the trainer restarts from its last checkpoint."""


class TTTObjective(torch.nn.Module):
    """The TTT loss as a module's forward, so DistributedDataParallel sees the whole step's graph and
    averages every parameter's gradient. Returns (loss, TTTOutput)."""

    def __init__(self, head: Eagle3DraftHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, batch: TTTBatch, steps: int, decay: float, max_loss_rows: int | None,
                generator: torch.Generator | None = None):
        out = ttt_loss(self.head, batch, steps=steps, decay=decay, max_loss_rows=max_loss_rows, generator=generator)
        return out.loss, out


def shards(rows: Sequence[TrafficRow], workers: int) -> list[list[TrafficRow]]:
    """Round-robin rows over workers; with fewer rows than workers the spare workers get copies."""
    if not rows:
        raise ValueError("a step needs at least one row")
    out: list[list[TrafficRow]] = [list(rows[w::workers]) for w in range(workers)]
    for w in range(len(rows), workers):
        out[w] = [rows[w % len(rows)]]
    return out


def merge_stats(stats: Sequence[StepStats], tokens: int) -> StepStats:
    """One step's statistics over all workers: losses weighted by the positions each scored, counts summed
    (the gradient norm and the skip decision are the same on every worker after the all-reduce)."""
    first = stats[0]
    steps = len(first.step_loss)
    count = [sum(s.step_count[j] for s in stats) for j in range(steps)]
    step_loss = tuple(sum(s.step_loss[j] * s.step_count[j] for s in stats) / count[j] if count[j] else 0.0
                      for j in range(steps))
    weights = [max(1, sum(s.step_count)) for s in stats]
    loss = sum(s.loss * w for s, w in zip(stats, weights)) / sum(weights)
    return dataclasses.replace(first, loss=loss, tokens=tokens, step_loss=step_loss,
                               step_correct=tuple(sum(s.step_correct[j] for s in stats) for j in range(steps)),
                               step_count=tuple(count), skipped=any(s.skipped for s in stats))


def head_payload(head: Eagle3DraftHead, opt: torch.optim.Optimizer | None) -> dict:
    """What a worker needs to rebuild `head` (its embedding comes from the worker's own target)."""
    return {"config": head.cfg.to_dict(), "state": head_weights(head),
            "optimizer": opt.state_dict() if opt is not None else None}


def _worker_loop(config: dict) -> None:
    """train_loop_per_worker: serve the coordinator's messages until "stop"."""
    import ray.train
    import ray.train.torch
    from torch.nn.parallel import DistributedDataParallel

    rank = ray.train.get_context().get_world_rank()
    inbox, outbox = config["inboxes"][rank], config["outbox"]
    by_position = config["split"] == "positions"
    device = ray.train.torch.get_device()
    torch.set_num_threads(max(1, int(config["threads"])))
    if config["target_builder"] is not None:
        target = config["target_builder"]()
    else:
        from adaptive_eagle.targets import load_target

        target = load_target(config["target"], device=str(device), purpose="train")
    head = model = opt = None
    outbox.put((rank, "ready", None))
    while True:
        kind, payload = inbox.get()
        try:
            if kind == "stop":
                outbox.put((rank, "stop", None))  # the answer _collect("stop") waits for
                return
            if kind == "load":
                head = head_from_weights(payload["config"], payload["state"], target).float().to(device).train()
                model = None if by_position else DistributedDataParallel(
                    TTTObjective(head), find_unused_parameters=True, broadcast_buffers=False)
                opt = adamw(head, payload["lr"], payload["weight_decay"])
                if payload["optimizer"] is not None:
                    opt.load_state_dict(payload["optimizer"])
                reply = None
            elif kind == "step" and by_position:
                rows, step, lr, step_cfg = payload
                set_lr(opt, lr)
                stats, regenerated = sequence_parallel_step(target, head, opt, rows, step, step_cfg, device=device)
                reply = (stats, stats.tokens, regenerated)
            elif kind == "step":
                rows, step, lr, step_cfg = payload
                tb = make_traffic_batch(target, head, rows, device)
                set_lr(opt, lr)

                def objective(batch, cfg=step_cfg, model=model):
                    return model(batch, cfg.ttt_steps, cfg.step_decay, cfg.max_loss_rows)

                stats = train_step(head, tb.batch, opt, None, step_cfg, step=step, objective=objective)
                reply = (stats, tb.tokens, tb.regenerated)
            elif kind == "state":
                reply = head_payload(head, opt) if rank == 0 else None
            else:
                raise ValueError(f"unknown message {kind!r}")
        except Exception as e:  # the coordinator raises it; Ray Train ends the group when we re-raise
            outbox.put((rank, "error", f"{type(e).__name__}: {e}"))
            raise
        outbox.put((rank, kind, reply))


class DataParallelStep:
    """The coordinator's handle on a Ray Train worker group running `_worker_loop`.

    workers: group size; device: "cpu" or "cuda" (one GPU a worker); cpus_per_worker: Ray CPUs (and torch
    threads) each; target: the target name or directory the workers load, or target_builder (a picklable
    callable, e.g. for tests); storage: Ray Train's run directory; split: "rows" (data parallel, DDP) or
    "positions" (sequence parallel: every row split by position over the workers, trainer/seqpar.py)."""

    def __init__(self, workers: int, *, device: str, storage: Path, target: str | None = None,
                 target_builder: Callable[[], object] | None = None, cpus_per_worker: float = 1.0,
                 name: str = "nearline-ddp", split: str = "rows") -> None:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
        from ray.util.queue import Queue

        if workers < 2:
            raise ValueError(f"workers {workers} must be >= 2 (one worker trains in-process)")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not ray.is_initialized():
            raise ScaleOutError("workers > 1 needs a running Ray cluster (ray.init or a Ray actor)")
        self.workers, self.split = workers, split
        self.inboxes = [Queue() for _ in range(workers)]
        self.outbox = Queue()
        use_gpu = device.startswith("cuda")
        self.resources = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        config = {"inboxes": self.inboxes, "outbox": self.outbox, "target": target, "target_builder": target_builder,
                  "threads": cpus_per_worker, "split": split}
        self.trainer = TorchTrainer(
            _worker_loop, train_loop_config=config,
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu,
                                         resources_per_worker={"CPU": cpus_per_worker}),
            run_config=RunConfig(name=name, storage_path=str(Path(storage).resolve())))
        self.error: str | None = None
        self._thread = threading.Thread(target=self._fit, name="nearline-ddp-fit", daemon=True)
        self._thread.start()
        self._collect("ready")

    def _fit(self) -> None:
        try:
            self.trainer.fit()
        except Exception as e:  # noqa: BLE001 - reported to the coordinator's next call
            self.error = f"{type(e).__name__}: {e}"
            log.error("data-parallel trainer ended: %s", self.error)

    def _collect(self, kind: str) -> list:
        """Every rank's reply to the last message, in rank order."""
        from ray.util.queue import Empty

        replies: dict[int, object] = {}
        waited = 0.0
        while len(replies) < self.workers:
            try:
                rank, got, reply = self.outbox.get(timeout=5.0)
            except Empty:
                waited += 5.0
                if not self._thread.is_alive():
                    raise ScaleOutError(f"the worker group ended: {self.error or 'no reason given'}") from None
                if waited >= REPLY_TIMEOUT_S:
                    hint = (f": does the cluster have {self.workers} x {self.resources} free for the workers?"
                            if kind == "ready" else "")
                    raise ScaleOutError(f"no reply to {kind!r} from {self.workers - len(replies)} worker(s) "
                                        f"in {REPLY_TIMEOUT_S:.0f} s{hint}") from None
                continue
            if got == "error":
                raise ScaleOutError(f"worker {rank}: {reply}")
            if got != kind:
                raise ScaleOutError(f"worker {rank} answered {got!r} to {kind!r}")
            replies[rank] = reply
        return [replies[r] for r in range(self.workers)]

    def _send(self, kind: str, payloads: Sequence[object]) -> list:
        if self.error is not None:
            raise ScaleOutError(f"the worker group ended: {self.error}")
        for inbox, payload in zip(self.inboxes, payloads):
            inbox.put((kind, payload))
        return self._collect(kind)

    def load(self, head: Eagle3DraftHead, opt: torch.optim.Optimizer | None, lr: float, weight_decay: float) -> None:
        """Every worker starts from `head` (and `opt`'s moments, when given)."""
        payload = {**head_payload(head, opt), "lr": lr, "weight_decay": weight_decay}
        self._send("load", [payload] * self.workers)

    def step(self, rows: Sequence[TrafficRow], step: int, lr: float, cfg: StepConfig) -> tuple[StepStats, int, int]:
        """One optimizer step on the worker group: (merged stats, tokens, regenerated rows). Data parallel: copies
        given to spare workers are not counted twice. Sequence parallel: every worker gets every row, reports the
        whole batch's statistics and its own shard's tokens (each regenerates the rows without features)."""
        if self.split == "positions":
            if not rows:
                raise ValueError("a step needs at least one row")
            replies = self._send("step", [(list(rows), step, lr, cfg)] * self.workers)
            tokens = sum(r[1] for r in replies)
            return dataclasses.replace(replies[0][0], tokens=tokens), tokens, replies[0][2]
        parts = shards(rows, self.workers)
        replies = self._send("step", [(part, step, lr, cfg) for part in parts])
        real = min(len(rows), self.workers)  # workers holding rows of their own (the rest hold copies)
        tokens = sum(r[1] for r in replies[:real])
        return merge_stats([r[0] for r in replies[:real]], tokens), tokens, sum(r[2] for r in replies[:real])

    def state(self) -> dict:
        """Rank 0's head weights (without the embedding) and optimizer state."""
        return self._send("state", [None] * self.workers)[0]

    def close(self, timeout_s: float = 60.0) -> None:
        if self._thread.is_alive() and self.error is None:
            try:
                self._send("stop", [None] * self.workers)
            except ScaleOutError as e:
                log.warning("stopping the worker group: %s", e)
        self._thread.join(timeout_s)
        for q in [*self.inboxes, self.outbox]:
            q.shutdown()


__all__ = ["SPLITS", "DataParallelStep", "ScaleOutError", "TTTObjective", "head_payload", "merge_stats", "shards"]
