"""What to do about a hang, by where the rank behind is: the fix texts of ``hang``.

Kept apart from ``hang.py`` (the rule and its message) so that each stays
short; ``{r}`` is the rank, ``{m}`` minutes, ``{path}`` a file.
"""

from __future__ import annotations

#: What a rank stuck outside every collective is likely doing, by phase.
BEHIND_HINTS = {
    "data": (
        "Rank {r} is stuck getting its next batch: a DataLoader worker that died or hangs, "
        "blocking reads from storage or the network, a lock shared with another thread."
    ),
    "idle": (
        "Rank {r} is between steps in its own code (after optimizer.step(), before its next "
        "forward): logging, checkpointing, evaluation or a sleep on that rank only."
    ),
    "forward": (
        "Rank {r} is inside its forward: a rank-dependent branch, a custom op that blocks, or "
        "a device that stopped responding."
    ),
    "save": (
        "Rank {r} has been inside torch.save for minutes while the others wait: storage that "
        "stopped answering (a network file system), a full disk, or a checkpoint too large "
        "to write within the collective timeout. Write to local disk and copy in the "
        "background, or save asynchronously (torch.distributed.checkpoint.async_save)."
    ),
}
BEHIND_HINTS["backward"] = BEHIND_HINTS["forward"].replace("forward", "backward")
#: A behind rank that computes (runnable most of the time) outside every collective.
COMPUTING_HINT = (
    "Rank {r} has been computing outside any collective for over {m:.0f} minutes while the "
    "others wait: evaluation, metrics or preprocessing run on that rank only, or a loop "
    "that does not end. Run such work on every rank (each on its shard) or outside the "
    "training job, or check the loop in its stack."
)


#: Every rank in the same collective, at the same step and place, and it never completes.
SAME_COLLECTIVE_HINT = (
    "All ranks reached this collective and wait in it: tensors whose shapes or dtypes "
    "differ between ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL checks them), a communication "
    "hook or backend that deadlocks (PowerSGD on gloo does), or a connection between two "
    "ranks that dropped; on NCCL, TORCH_NCCL_ASYNC_ERROR_HANDLING and the Flight Recorder "
    "(TORCH_FR_BUFFER_SIZE) show which peer stopped answering."
)
#: A behind rank blocked on a regular file (Heartbeat.io_op, io_path) for minutes.
WRITING_HINT = (
    "Rank {r} has been blocked writing {path} for over {m:.0f} minutes while the others "
    "wait: storage that stopped answering (a network file system), a full disk, or a "
    "checkpoint too large to write within the collective timeout. Write to local disk and "
    "copy in the background, or save asynchronously (torch.distributed.checkpoint."
    "async_save, Lightning's AsyncCheckpointIO)."
)
READING_HINT = (
    "Rank {r} has been blocked reading {path} for over {m:.0f} minutes while the others "
    "wait: storage that stopped answering (a network file system), or a large read on "
    "the training thread. Read data in DataLoader workers (num_workers > 0), and stage "
    "large files on local disk first."
)
#: A behind rank whose training thread waits while its process moves data (moved_bps).
MOVING_HINT = (
    "Rank {r} has been waiting on its own threads for over {m:.0f} minutes while its "
    "process moves data and the others wait: a checkpoint upload (boto3, s3fs, an "
    "asynchronous writer) or a download that the training thread waits for. Let training "
    "go on while it transfers (wait for it only before the next upload), transfer after "
    "training, or check the storage's throughput."
)
