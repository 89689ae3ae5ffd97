"""Running a job: distributed start-up, the optimizer, the training loop and its step hooks,
validation, checkpoints."""
