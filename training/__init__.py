"""Pieces of the training loop that are not a parallelism: process setup, optimizer, LR
schedule, loss, the step function, validation."""
