"""Infrastructure behind thin seams: torchrun/DDP/FSDP, checkpoints, run logs."""
