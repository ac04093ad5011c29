"""How messages and tensors cross process boundaries, in three parts:

- `runtime.transport.shm`: tensors in shared-memory files (`SharedTensor`), named per process and
  swept when a process is gone, and the budget for mapping them (`MapBudget`);
- `runtime.transport.frames`: a message as a pickle plus its tensors' bytes out of band
  (`to_frames`, `from_frames`);
- `runtime.transport.broadcast`: rank 0's received frames on every scheduler rank
  (`broadcast_frames`) and the release of the media files every rank has read.
"""
